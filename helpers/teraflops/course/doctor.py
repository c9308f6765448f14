"""``teraflops doctor``: what this machine offers the course, and what the course will skip here.

Paste its output into a bug report: versions, devices, how Triton runs, which C++ compiler
``torch.compile`` would use on CPU, the GPU interconnect, and the list of course parts that are
skipped on this machine with the reason for each.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import platform
import shutil
import subprocess
import sys

from teraflops import sizing
from teraflops.compilation import loadgen, serving
from teraflops.errors import CourseError
from teraflops.course import any_folder
from teraflops.machine import GiB, Machine, detect, triton_mode
from teraflops.launch.ops import aio_unavailable
from teraflops.launch.placement import place

__all__ = ["compute_mode_lines", "compute_modes", "doctor", "skipped"]

_INDENT = "  "


def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def _module_version(name: str) -> str:
    try:
        module = __import__(name)
    except Exception as e:  # ImportError, but also broken installs raising anything else
        return f"not importable: {type(e).__name__}: {_first_line(e)}"
    return str(getattr(module, "__version__", "unknown version"))


def _deepspeed_version() -> str:
    """Import DeepSpeed without its import-time chatter (e.g. the accelerator warning).

    DeepSpeed's logger writes to the ``sys.stdout`` it finds when first imported; the handler is
    pointed back at the real stream afterwards, so later DeepSpeed logging is not lost.
    """
    if "deepspeed" in sys.modules:
        return _module_version("deepspeed")
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        version = _module_version("deepspeed")
    for handler in logging.getLogger("DeepSpeed").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sink:
            handler.setStream(sys.stdout)
    return version


def _run(cmd: list[str], timeout: float = 20) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, f"{type(e).__name__}: {_first_line(e)}"
    return p.returncode, (p.stdout or "") + (p.stderr or "")


def _versions() -> list[str]:
    import torch

    rows = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", torch.__version__),
        ("triton", _module_version("triton")),
        ("deepspeed", _deepspeed_version()),
        ("numpy", _module_version("numpy")),
        ("CUDA runtime", torch.version.cuda or "none (torch built without CUDA)"),
    ]
    if getattr(torch.version, "hip", None):
        rows.append(("ROCm/HIP", torch.version.hip))
    rows.append(("NCCL", _nccl_version()))
    width = max(len(k) for k, _ in rows)
    return [f"{_INDENT}{k:<{width}}  {v}" for k, v in rows]


def _nccl_version() -> str:
    import torch

    if not torch.cuda.is_available():
        return "not used (no CUDA device; torch.distributed uses gloo)"
    nccl = getattr(torch.cuda, "nccl", None)
    if nccl is None or not hasattr(nccl, "version"):
        return "not available in this torch build"
    try:
        v = nccl.version()
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {_first_line(e)}"
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _devices(m: Machine) -> list[str]:
    lines = [
        f"{_INDENT}{m.summary()}",
        f"{_INDENT}kind: {m.kind}; data-parallel runs: {place(None, cpu_ranks=2, min_ranks=2, machine=m).note}",
    ]
    for g in m.gpus:
        lines.append(
            f"{_INDENT}GPU {g.index}: {g.name}, {g.memory_bytes / GiB:.1f} GiB, "
            f"compute capability {g.capability[0]}.{g.capability[1]}"
        )
    lines.append(f"{_INDENT}torch CPU threads: {m.cpu_threads}")
    return lines


def _preset() -> list[str]:
    """The size preset in force and where it came from (``TERAFLOPS_PRESET`` or the machine)."""
    env = os.environ.get("TERAFLOPS_PRESET")
    try:
        name = sizing.preset_name()
    except CourseError as e:
        return [f"{_INDENT}{' '.join(str(e).split())}"]
    source = f"TERAFLOPS_PRESET={env}" if env else "chosen for this machine; TERAFLOPS_PRESET overrides it"
    what = {"tiny": "smoke tests of the code paths only: timings are noise, not the lectures' story",
            "cpu": "sizes that keep a lecture to a few minutes on a 2-core CPU",
            "gpu": "sizes fitted to this GPU's memory"}.get(name, "")
    return [f"{_INDENT}{name} ({source}){': ' + what if what else ''}"]


def _triton() -> list[str]:
    mode = triton_mode()
    env = os.environ.get("TRITON_INTERPRET", "unset")
    why = (
        "kernels run in Triton's interpreter (NumPy on the CPU): right answers, GPU-less speed"
        if mode == "interpreter"
        else "kernels are compiled for the GPU"
    )
    return [f"{_INDENT}mode: {mode} (TRITON_INTERPRET={env}): {why}"]


def _compiler() -> list[str]:
    lines = []
    try:
        from torch._inductor import config as inductor_config

        lines.append(f"{_INDENT}torch._inductor.config.cpp.cxx = {inductor_config.cpp.cxx!r}")
    except Exception as e:
        reason = f"{type(e).__name__}: {_first_line(e)}"
        lines.append(f"{_INDENT}torch._inductor config unavailable: {reason}")
    found_any = False
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path is None:
            lines.append(f"{_INDENT}{name}: not found")
            continue
        found_any = True
        rc, out = _run([path, "--version"])
        version = _first_line(out) or f"--version exit code {rc}"
        lines.append(f"{_INDENT}{name}: {path} ({version})")
    if not found_any:
        lines.append(f"{_INDENT}no C++ compiler: torch.compile cannot generate CPU kernels here")
    return lines


def _links(m: Machine) -> list[str]:
    lines = [f"{_INDENT}GPUs visible to torch: {m.gpu_count}"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        lines.append(f"{_INDENT}nvidia-smi: absent, so no interconnect topology to show")
        return lines
    rc, out = _run([smi, "topo", "-m"])
    if rc != 0:
        lines.append(f"{_INDENT}nvidia-smi topo -m failed (exit {rc}): {_first_line(out)}")
        return lines
    lines.append(f"{_INDENT}nvidia-smi topo -m:")
    lines += [f"{_INDENT * 2}{line.rstrip()}" for line in out.rstrip().splitlines()]
    return lines


# One line per GPU, "INDEX, MODE" (nvidia-smi --help-query-gpu: compute_mode is Default, Exclusive_Process
# or Prohibited; Exclusive_Thread on old drivers)
COMPUTE_MODE_QUERY = ("--query-gpu=index,compute_mode", "--format=csv,noheader")
_SHARED = ("{mode}: one CUDA {what} at a time, so the notebook's kernel, rank 0 and the Triton server, which all "
           "want GPU {i}, collide (the second cannot create its CUDA context). Fix: `sudo nvidia-smi -i {i} -c "
           "DEFAULT`, or run one process per GPU (CUDA_VISIBLE_DEVICES)")
_MODE_LINE = {
    "Exclusive_Process": _SHARED.replace("{what}", "process"),
    "Exclusive_Thread": _SHARED.replace("{what}", "context"),
    "Prohibited": "{mode}: no CUDA process may use it. Fix: `sudo nvidia-smi -i {i} -c DEFAULT`, or hide it "
                  "(CUDA_VISIBLE_DEVICES without {i})",
}


def compute_modes(text: str) -> list[tuple[int, str]]:
    """``(GPU index, compute mode)`` for each ``INDEX, MODE`` line of nvidia-smi's answer to
    :data:`COMPUTE_MODE_QUERY`; other lines (errors, ``[N/A]`` indices) are left out."""
    found = []
    for line in str(text).splitlines():
        index, sep, mode = line.partition(",")
        if sep and index.strip().isdigit() and mode.strip():
            found.append((int(index), mode.strip()))
    return found


def compute_mode_lines(returncode: int | None, out: str) -> list[str]:
    """The doctor's lines on the GPUs' compute modes from nvidia-smi's exit code and output
    (``returncode`` None: no nvidia-smi): one per GPU, and for a GPU that several of the course's
    processes cannot share, that line names the GPU and the fix."""
    if returncode is None:
        return [f"{_INDENT}nvidia-smi: absent, so the GPUs' compute modes are unknown"]
    modes = compute_modes(out) if returncode == 0 else []
    if not modes:
        return [f"{_INDENT}nvidia-smi {' '.join(COMPUTE_MODE_QUERY)} failed (exit {returncode}): "
                f"{_first_line(out) or 'no GPU listed'}"]
    return [f"{_INDENT}GPU {i}: " + _MODE_LINE.get(mode, "{mode}").format(mode=mode, i=i) for i, mode in modes]


def _compute_modes() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return compute_mode_lines(None, "")
    return compute_mode_lines(*_run([smi, *COMPUTE_MODE_QUERY]))


def _serving() -> list[str]:
    """Unit 4's real server (PyTriton's Triton Inference Server) and Triton's load generator perf_analyzer."""
    server = serving.why_not()
    pytriton = (f"nvidia-pytriton {serving.metadata.version('nvidia-pytriton')}: ready (127.0.0.1 only)"
                if server is None else f"cannot run: {server}")
    load = loadgen.why_not()
    perf = f"{loadgen.binary()}: ready" if load is None else f"cannot run: {load}"
    return [f"{_INDENT}Triton Inference Server  {pytriton}", f"{_INDENT}perf_analyzer            {perf}"]


def skipped(m: Machine | None = None) -> list[str]:
    """What the course skips on machine ``m`` (default: this one), one reason per entry."""
    m = m or detect()
    folder = any_folder.problem()  # first: it breaks builds of several units, not one part
    items = [folder] if folder else []
    if not m.gpus:
        items += [
            'CUDA graphs and torch.compile(mode="reduce-overhead"): need a GPU',
            "naive-attention out-of-memory sweep: runs only on a GPU",
            "NCCL collectives: need GPUs; the distributed units use gloo on CPU processes instead",
        ]
    if triton_mode() == "interpreter":
        items.append("bf16 Triton kernels: the Triton interpreter has no bf16, so fp32 is used")
    for reason in (serving.why_not(), loadgen.why_not()):
        if reason:
            items.append(f"Unit 4's real server under perf_analyzer: {reason}")
            break
    aio = aio_unavailable()
    if aio:
        items.append(f"Unit 5's NVMe offload run: {aio}")
    if not m.gpus:
        items.append("multi-GPU link (NVLink/PCIe) measurements: need at least 2 GPUs")
    elif m.gpu_count == 1:
        items.append("multi-GPU NVLink measurements: need at least 2 GPUs, this machine has 1")
    return items


def doctor() -> str:
    """A multi-line report on this machine for the course (see module docstring)."""
    m = detect()
    sections = [
        ("Versions", _versions()),
        ("Devices", _devices(m)),
        ("Size preset", _preset()),
        ("Triton", _triton()),
        ("C++ compiler for torch.compile on CPU", _compiler()),
        ("GPUs and links", _links(m)),
        ("GPU compute modes (the course runs several processes on GPU 0)", _compute_modes()),
        ("Serving (Unit 4)", _serving()),
    ]
    skips = skipped(m)
    nothing = [f"{_INDENT}nothing: every part of the course runs here"]
    sections.append(("Skipped on this machine", [f"{_INDENT}- {s}" for s in skips] or nothing))
    out = ["Tensors to Teraflops doctor"]
    for title, lines in sections:
        out += ["", title] + lines
    return "\n".join(out)
