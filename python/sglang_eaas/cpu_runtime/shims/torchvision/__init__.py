"""Import-only stub of torchvision for CPU torch builds.

PyPI's torchvision wheels need CUDA torch; SGLang and transformers import torchvision (and a few
submodules) unconditionally, but text-only models never call it. Any real use raises RuntimeError.
"""

import enum
import sys
import types

__version__ = "0.0.0+sglang_eaas.stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = 4


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision stub: {type(self).__name__} is not available")


def _stub_module(name: str, **attrs) -> types.ModuleType:
    """Register a module whose unknown attributes are unusable stand-ins (classes or functions)."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr[:1].isupper():
            return type(attr, (_Unavailable,), {})

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"torchvision stub: {name}.{attr} is not available")

        return unavailable

    mod.__getattr__ = __getattr__
    sys.modules[name] = mod
    return mod


transforms = _stub_module("torchvision.transforms", InterpolationMode=InterpolationMode)
transforms.functional = _stub_module(
    "torchvision.transforms.functional", InterpolationMode=InterpolationMode
)
transforms.v2 = _stub_module("torchvision.transforms.v2", InterpolationMode=InterpolationMode)
transforms.v2.functional = _stub_module(
    "torchvision.transforms.v2.functional", InterpolationMode=InterpolationMode
)
io = _stub_module("torchvision.io", ImageReadMode=ImageReadMode)
ops = _stub_module("torchvision.ops")
datasets = _stub_module("torchvision.datasets")
models = _stub_module("torchvision.models")
utils = _stub_module("torchvision.utils")
