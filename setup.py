"""sglang-eaas: disaggregated Mixture-of-Experts serving as an SGLang plugin."""

from setuptools import find_packages, setup

setup(
    name="sglang-eaas",
    version="0.1.0",
    description="Expert-as-a-Service for SGLang: routed experts on separate, stateless expert servers",
    package_dir={"": "python"},
    packages=find_packages("python"),
    # The CPU runtime's stand-in packages are plain folders put on sys.path, not subpackages.
    package_data={"sglang_eaas.cpu_runtime": ["shims/*/*.py"]},
    python_requires=">=3.10",
    # SGLang is not a hard requirement: on a CPU-only machine scripts/setup.sh installs it with
    # --no-deps plus requirements/sglang-cpu.txt, because its pinned CUDA kernels cannot install there.
    extras_require={
        "gpu": ["sglang==0.5.23"],
        "test": ["pytest>=8", "hypothesis>=6", "requests>=2.31"],
    },
    entry_points={
        "sglang.srt.plugins": ["eaas = sglang_eaas.plugin:register"],
        "console_scripts": ["sglang-eaas-make-tiny-model = sglang_eaas.tools.make_tiny_model:main"],
    },
)
