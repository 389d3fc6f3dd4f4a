"""setuptools' PEP 517 backend, with jaxlib added to what a wheel's build needs (setup.py builds
the C++ CPU kernel against its XLA FFI headers); an editable install or an sdist needs only
setuptools."""
from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the backend's hooks, unchanged)

JAXLIB = "jaxlib>=0.10,<0.13"


def get_requires_for_build_wheel(config_settings=None):
    return [*_setuptools.get_requires_for_build_wheel(config_settings), JAXLIB]
