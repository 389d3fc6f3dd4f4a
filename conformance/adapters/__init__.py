"""The adapters: one per attention implementation, each behind the same ``Adapter`` interface.

``base`` holds the interface and the adapter for any JAX function with flash_attention's
signature (plug-ins use it); ``jax_side`` and ``torch_side`` hold the frameworks' own
implementations. ``conformance.registry`` lists them.
"""
