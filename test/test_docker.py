"""docker/: the GPU and CPU images' Dockerfiles, checked without Docker (none on these machines,
so no image is built here): each parsed by dockerfile-parse and linted by hadolint; the GPU image
built from SGLang's published image of the release setup.py pins; the CPU image running the
README's setup; every COPY'd path in the repository and in the build context; the manifests
naming the image docs/deployment.md says to build. scripts/check_docker.py runs the CPU image's
RUN steps in a clean venv (by hand; docs/deployment.md, "Images")."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from docker_lib import dockerfile, hadolint, pins

import k8s_manifests as k8s

ROOT = dockerfile.ROOT
KINDS = sorted(dockerfile.DOCKERFILES)
DOCS = ROOT / "docs" / "deployment.md"
BUILD = re.compile(r"^docker build -f (docker/Dockerfile\.(\w+)) -t (\S+) \.$")
PUSH = re.compile(r"^docker push (\S+)$")


def image(kind: str) -> dockerfile.Dockerfile:
    return dockerfile.read(dockerfile.DOCKERFILES[kind])


@functools.cache
def tracked() -> tuple[str, ...]:
    """The repository's files (git's list: what a checkout has, not what a machine made)."""
    return tuple(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.splitlines())


def run_words(kind: str) -> list[str]:
    """Every word of the image's RUN steps, as the shell would split them (quotes removed)."""
    return [w for step in image(kind).of("RUN") for w in shlex.split(step.value, comments=True)]


@pytest.mark.parametrize("kind", KINDS)
def test_each_dockerfile_parses_into_one_stage_with_a_default_command(kind):
    steps = image(kind).steps
    known = {"FROM", "ARG", "ENV", "SHELL", "RUN", "WORKDIR", "USER", "COPY", "EXPOSE", "CMD"}
    assert {s.instruction for s in steps} <= known, f"{kind}: {[s.instruction for s in steps]}"
    assert [s.instruction for s in steps].count("FROM") == 1
    assert steps[-1].instruction == "CMD" and image(kind).cmd()[:2] == ["python", "-m"]


def test_hadolint_finds_nothing_in_either_dockerfile():
    done = hadolint.lint(list(dockerfile.DOCKERFILES.values()))
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_hadolint_refuses_a_broken_dockerfile(tmp_path):
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python\nRUN cd /tmp && pip install requests\n")
    done = hadolint.lint([broken])
    assert done.returncode != 0
    assert {"DL3006", "DL3003", "DL3013"} <= set(re.findall(r"DL\d+", done.stdout)), done.stdout


def test_the_gpu_image_starts_from_sglangs_image_of_the_pinned_release():
    gpu = image("gpu")
    assert gpu.base == f"lmsysorg/sglang:v{pins.sglang_version()}"
    assert gpu.arg_defaults["SGLANG_VERSION"] == pins.sglang_version()
    # no pip install names sglang: the base's own install and its dependencies stay as they are
    for step in gpu.of("RUN"):
        for args in re.findall(r"pip install(.*?)(?:&&|\|\||;|$)", step.value):
            assert not re.search(r"(^|[\s\"'])sglang(\[|[=<>~!]|[\s\"']|$)", args), args


def _python_programs(kind: str, version: str) -> list[str]:
    """The ``python3 -c PROGRAM`` checks of the image's RUN steps, ``${SGLANG_VERSION}`` set."""
    programs = []
    for step in image(kind).of("RUN"):
        words = shlex.split(step.value.replace("${SGLANG_VERSION}", version))
        programs += [words[i + 1] for i, w in enumerate(words[1:], 1)
                     if w == "-c" and words[i - 1] == "python3"]
    return programs


def test_the_gpu_images_own_checks_pass_here_and_refuse_another_release():
    """Its checks that the base is the pinned SGLang with the plugin registered, run in this
    environment (which has both) as they run in the build; and given another release."""
    programs = _python_programs("gpu", pins.sglang_version())
    assert len(programs) == 2
    for program in programs:
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
    (version_check,) = [p for p in _python_programs("gpu", "0.0.1") if "0.0.1" in p]
    done = subprocess.run([sys.executable, "-c", version_check], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "not 0.0.1" in done.stderr.strip().splitlines()[-1]


def test_the_gpu_image_takes_its_build_pins_from_requirements():
    runs = " ".join(step.value for step in image("gpu").of("RUN"))
    greps = re.findall(r"grep -x '([^']+)' (\S+)\)", runs)
    assert greps
    for pattern, path in greps:
        lines = (ROOT / path).read_text().splitlines()
        assert len([line for line in lines if re.fullmatch(pattern, line)]) == 1, (pattern, path)


def test_the_cpu_image_runs_the_readme_setup_as_an_unprivileged_user():
    cpu = image("cpu")
    words = run_words("cpu")
    assert "scripts/setup.sh" in words
    assert cpu.arg_defaults["TORCH_VERSION"] == pins.torch_version()
    python = re.fullmatch(r"python:(\d+)\.(\d+)\.\d+-slim-\w+", cpu.base)
    assert python and tuple(map(int, python.groups())) >= pins.python_requires(), cpu.base
    # what setup.sh would apt-get as root, so that it can run as the image's user
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    assert set(re.findall(r"apt_install (\S+) \|\|", setup_sh)) | {"gcc", "g++"} <= set(words)
    user = cpu.of("USER")[-1].value
    assert re.fullmatch(r"[1-9]\d*:\d+", user), f"USER {user}: not a numeric non-root user"


@pytest.mark.parametrize("kind", KINDS)
def test_every_copied_path_exists_reaches_the_builder_and_keeps_its_place(kind):
    for copy in image(kind).copies():
        assert not [f for f in copy.flags if f.startswith("--from")], copy
        for source in copy.sources:
            assert (ROOT / source).exists(), f"{kind}: COPY {source}: not in the repository"
            assert dockerfile.in_context(source), f"{kind}: COPY {source}: in .dockerignore"
            assert copy.dest in (source, "./") and (copy.dest != "./" or "/" not in source)
            inside = [f for f in tracked() if f == source or f.startswith(source)]
            assert inside and all(dockerfile.in_context(f) for f in inside), source
    for generated in (".venv/bin/python", "python/sglang_eaas/__pycache__/plugin.cpython-311.pyc",
                      "ibgda/_host_atomics.cpython-311-x86_64-linux-gnu.so", ".git/HEAD"):
        assert not dockerfile.in_context(generated), generated


@pytest.mark.parametrize("kind", KINDS)
def test_the_files_the_run_steps_and_the_command_name_are_copied(kind):
    copied = [s.rstrip("/") for c in image(kind).copies() for s in c.sources]
    words = [w for step in image(kind).of("RUN") for w in re.findall(r"[\w.+/-]+", step.value)]
    in_repo = [w for w in words + image(kind).cmd() if re.search(r"[./]", w)
               and any(f == w or f.startswith(w.rstrip("/") + "/") for f in tracked())]
    assert in_repo
    for path in in_repo:
        assert any(path == c or path.startswith(c + "/") for c in copied), f"{kind}: {path}"


def _documented_builds() -> dict[str, str]:
    """{kind: tag} of the docs' `docker build` commands, each pushed too."""
    lines = [line.strip() for line in DOCS.read_text().splitlines()]
    builds = {m.group(2): m.group(3) for m in map(BUILD.match, lines) if m}
    pushed = {m.group(1) for m in map(PUSH.match, lines) if m}
    assert set(builds.values()) <= pushed, "every image the docs build, they push"
    for kind, tag in builds.items():  # each Dockerfile's header says the same
        header = dockerfile.DOCKERFILES[kind].read_text()
        assert f"docker build -f docker/Dockerfile.{kind} -t {tag} ." in header, kind
    return builds


def test_the_manifests_name_the_image_the_docs_say_to_build_and_push():
    builds = _documented_builds()
    assert sorted(builds) == KINDS
    kustomization = yaml.safe_load((k8s.K8S / "kustomization.yaml").read_text())
    (mapped,) = [i for i in kustomization["images"] if i["name"] == dockerfile.IMAGE]
    for kind, tag in builds.items():
        assert tag == f"{mapped['newName']}:{pins.package_version()}-{kind}", tag
    assert f"{mapped['newName']}:{mapped['newTag']}" == builds["gpu"]
    ours = [k8s.container(w)["image"] for w in k8s.WORKLOADS
            if k8s.container(w)["image"].split(":")[0] == dockerfile.IMAGE]
    assert ours and set(ours) == {f"{dockerfile.IMAGE}:{mapped['newTag']}"}
