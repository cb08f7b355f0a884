"""FlexAttention's sm_90 forward kernel for ``layout.to_flex_block_mask()``, compiled without a GPU: the
shared memory, registers, spills and asynchronous copies of Flex's forward Triton kernel at Flex's own
default tiles for an H100/H200, per layout family and head dim.

How: Inductor is made to believe it runs on one sm_90 device (CUDA calls, the device's properties and
Triton's driver are stubbed; tensors are fake), so ``torch.compile(flex_attention)`` lowers the
``mask_mod`` into Flex's Triton template and writes the kernel source exactly as on the GPU; the
kernels are then compiled with Triton for ``cuda:90`` (:func:`sparse_io_attn._triton.aot.ptx_report`:
Triton's shared-memory figure, ``ptxas -v``). Nothing runs. A kernel whose shared memory exceeds
232,448 B (an H100/H200 block's limit) is the "out of resource" Inductor raises at the first call.
Inductor's pattern-matcher passes and the joint-graph constant folding are off (they evaluate example
graphs and captured tables on real device tensors); neither rewrites Flex's template. Not covered: the
backward kernels (autograd on a fake CUDA tensor aborts in a CPU-only torch: it needs a CUDA device
guard), so the next GPU run of ``bench_gpu_block_sparse.py`` is their check.

Calibration: ``legacy`` is the export before narrow tables (an int32 block table, then the int32
mask words it points to); on the H200 its forward failed with "Required: 262144" at D 128 and
376,832 at D 64 (``benchmarks/results/gpu_h200.md``), which this report must reproduce.

    TRITON_INTERPRET=0 python benchmarks/flex_compile_report.py   # writes results/flex_compile_report_sm90.{md,json}
    TRITON_INTERPRET=0 python benchmarks/flex_compile_report.py --n 1024 --d 64 --families random
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import sys
import tempfile
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_block_sparse import FAMILIES, make_layout  # noqa: E402

from sparse_io_attn._triton.aot import ptx_report  # noqa: E402
from sparse_io_attn.layout import _bits, _flex, patterns  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "flex_compile_report_sm90"
SM90_SHARED_LIMIT = 232_448  # bytes a block may use on an H100/H200 (the figure in Inductor's error)


# ------------------------------------------------------------------------------------ a fake sm_90
class _Props:
    name, major, minor, multi_processor_count, warp_size = "fake sm_90", 9, 0, 132, 32
    total_memory, regs_per_multiprocessor, max_threads_per_multi_processor = 80 * 2 ** 30, 65536, 2048
    shared_memory_per_block_optin, L2_cache_size, gcnArchName, uuid = SM90_SHARED_LIMIT, 50 * 2 ** 20, "", "fake"


class _Driver:
    """What Inductor asks Triton's active driver while it generates code for one sm_90 device."""
    backend = "cuda"

    class utils:  # noqa: N801
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": SM90_SHARED_LIMIT, "multiprocessor_count": 132, "max_num_regs": 65536,
                    "warpSize": 32, "sm_clock_rate": 1_980_000, "mem_clock_rate": 2_619_000, "mem_bus_width": 5120}

    def is_active(self):
        return True

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cuda", 0)

    def get_device_interface(self):
        return torch.cuda


def _set(obj, name, value, saved):
    saved.append((obj, name, getattr(obj, name, None)))
    setattr(obj, name, value)


@contextlib.contextmanager
def fake_sm90(sources: list):
    """Inductor generating CUDA code for one sm_90 device on this CPU machine; every Triton kernel it
    hands to ``async_compile.triton`` is appended to ``sources`` as ``(name, source)`` instead of
    compiled."""
    import sys as _sys

    from torch._inductor import async_compile
    from torch._inductor import config as inductor_config
    from torch._inductor.fx_passes import fuse_attention, misc_patterns, pad_mm

    hop = _sys.modules["torch._higher_order_ops.flex_attention"]
    saved: list = []
    cuda = torch.cuda
    stubs = {"is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
             "get_device_capability": lambda *a, **k: (9, 0), "get_device_properties": lambda *a, **k: _Props(),
             "get_rng_state": lambda *a, **k: torch.zeros(16, dtype=torch.uint8), "set_rng_state": lambda *a, **k: None,
             "_lazy_init": lambda: None, "is_initialized": lambda: True, "_exchange_device": lambda idx: 0,
             "_maybe_exchange_device": lambda idx: 0, "synchronize": lambda *a, **k: None}
    for name, value in stubs.items():
        _set(cuda, name, value, saved)
    _set(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, saved)
    from torch._dynamo.device_interface import CudaInterface     # bound torch.cuda's functions at import
    for name in ("get_device_properties", "current_device", "device_count", "synchronize"):
        _set(CudaInterface, name, staticmethod(getattr(cuda, name)), saved)
    _set(CudaInterface, "exchange_device", staticmethod(lambda idx: 0), saved)
    _set(CudaInterface, "maybe_exchange_device", staticmethod(lambda idx: 0), saved)
    _set(CudaInterface.Worker, "get_device_properties", staticmethod(lambda device=None: _Props()), saved)
    # pattern-matcher initialisers trace example graphs on real device tensors: not needed here
    for mod, name in ((fuse_attention, "_sfdp_init"), (pad_mm, "_pad_mm_init"), (misc_patterns, "_misc_patterns_init")):
        _set(mod, name, lambda *a, **k: None, saved)
    _set(hop, "_permute_strides", lambda out, strides: out, saved)   # copies a fake CUDA tensor
    _set(inductor_config, "compile_threads", 1, saved)
    _set(inductor_config, "pattern_matcher", False, saved)   # its passes trace examples on real device tensors
    _set(inductor_config, "joint_graph_constant_folding", False, saved)   # evaluates captured tables
    _set(inductor_config, "fx_graph_cache", False, saved)

    def record(self, kernel_name, source_code, device_str="cuda"):
        sources.append((kernel_name, source_code))
        return None
    _set(async_compile.AsyncCompile, "triton", record, saved)
    _set(async_compile.AsyncCompile, "wait", lambda self, scope: None, saved)
    from triton.runtime.driver import driver

    _set(driver, "_active", _Driver(), saved)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


# ------------------------------------------------------------------------------------ mask_mods
def legacy_mask_mod(layout, causal: bool):
    """The export before narrow tables (calibration only): an int32 block table, then the int32 mask
    words of the partial block it names, per element."""
    (bq, bk), (sq, sk) = layout.block_size, layout.seqlen
    R, C = layout.num_q_blocks, layout.num_kv_blocks
    table = layout.block_table()
    masks = layout.partial_masks if layout.partial_masks.shape[0] else torch.zeros(
        1, bq, _bits.num_words(bk), dtype=torch.int32)
    sb, sh = int(layout.layout_batch > 1), int(layout.layout_heads > 1)

    def mask_mod(b, h, q_idx, kv_idx):
        entry = table[b * sb, h * sh, torch.clamp(q_idx // bq, max=R - 1), torch.clamp(kv_idx // bk, max=C - 1)]
        kq, kk = q_idx % bq, kv_idx % bk
        word = masks[torch.clamp(entry, min=0), kq, kk // 32]
        keep = (entry == -1) | ((entry >= 0) & (((word >> (kk % 32)) & 1) == 1))
        keep = keep & (q_idx < sq) & (kv_idx < sk)
        return keep & (q_idx >= kv_idx) if causal else keep
    return mask_mod


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


def _on_fake_cuda(fn):
    """``fn`` with every tensor of its closure (and of the closures it calls) a fake CUDA tensor."""
    cells = []
    for cell in fn.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, torch.Tensor):
            value = _fake_like(value)
        elif isinstance(value, types.FunctionType) and value.__closure__:
            value = _on_fake_cuda(value)
        cells.append(types.CellType(value))
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells) or None)


def flex_kernels(block_mask, B: int, H: int, d: int, dtype: torch.dtype) -> list[tuple[str, str]]:
    """The Triton kernels (name, source) Inductor writes for the forward of ``flex_attention`` with
    ``block_mask`` on a sm_90 device at its default configuration."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention.flex_attention import flex_attention

    sources: list = []
    sq, sk = block_mask.seq_lengths
    torch._dynamo.reset()
    with fake_sm90(sources), FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(B, H, sq, d, device="cuda", dtype=dtype)
        k, v = (torch.empty(B, H, sk, d, device="cuda", dtype=dtype) for _ in range(2))
        bm = copy.copy(block_mask)
        for name, value in vars(block_mask).items():
            if isinstance(value, torch.Tensor):
                setattr(bm, name, _fake_like(value))
        bm.mask_mod = _on_fake_cuda(block_mask.mask_mod)
        try:
            torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=bm)
        except Exception:  # noqa: BLE001  (running the stubbed kernels fails once their source is recorded)
            if not sources:
                raise
    return [(n, s) for n, s in sources if "flex_attention" in n]


def compile_sm90(name: str, source: str, workdir: str) -> dict:
    """Compile one recorded Inductor kernel for sm_90 with the launch metadata it carries."""
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = Path(workdir) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tuner = getattr(mod, name)
    meta = tuner.triton_meta
    stages = int(re.search(r"num_stages=(\d+)", source).group(1))
    warps = int(re.search(r"num_warps=(\d+)", source).group(1))
    signature, constants = dict(meta["signature"]), dict(meta.get("constants", {}))
    signature.update({k: "constexpr" for k in constants})
    compiled = triton.compile(ASTSource(tuner.fn, signature, constexprs=constants, attrs=meta["configs"][0]),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    tiles = {k: int(v) for k, v in re.findall(r"\b(BLOCK_M\d?|BLOCK_N\d?)\s*:\s*tl\.constexpr\s*=\s*(\d+)", source)}
    return {"num_warps": warps, "num_stages": stages, "tiles": tiles, **ptx_report(compiled)}


# ------------------------------------------------------------------------------------ the report
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, nargs="+", default=[64, 128])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--density", type=float, default=0.10)
    p.add_argument("--families", nargs="+", default=list(FAMILIES) + list(EXTRA), choices=list(FAMILIES) + list(EXTRA))
    p.add_argument("--no-legacy", action="store_true", help="skip the calibration rows (the int32 export)")
    p.add_argument("--out", type=Path, default=None, help=f"output stem (default {OUT})")
    return p.parse_args(argv)


#: layouts beyond the GPU benchmark's families: ``(layout, causal)`` from ``(n, block)``
EXTRA = {
    "causal_full": lambda n, block: (patterns.causal(n, block), True),
    # the global token's column is a partial block that no interval explains: the uint8 mask bits
    "longformer": lambda n, block: (patterns.longformer(n, block, n // 20, global_tokens=[0, n // 2 + 3]), False),
}


def cases(args):
    for family in args.families:
        if family in EXTRA:
            layout, causal = EXTRA[family](args.n, args.block)
        else:
            layout, causal = make_layout(family, args.n, args.block, args.density, args.heads)
        bm = layout.to_flex_block_mask(causal)
        yield family, layout, causal, bm, "narrow", _flex.describe(bm.mask_mod)
        if not args.no_legacy and family == "random":
            legacy = copy.copy(bm)
            legacy.mask_mod = legacy_mask_mod(layout, causal)
            words = max(1, layout.partial_masks.shape[0])
            yield family, layout, causal, legacy, "legacy", {"rule": "int32 table + int32 words", "tables": {
                "table": f"int32{list(layout.block_table().shape)}", "masks": f"int32[{words}, ...]"}}


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, layout, causal, bm, export, desc in cases(args):
            for d in args.d:
                for name, source in flex_kernels(bm, 1, layout.layout_heads, d, torch.bfloat16):
                    row = {"family": family, "layout": layout.name, "causal": causal, "export": export, "D": d,
                           **desc, **compile_sm90(name, source, tmp)}
                    row["fits_sm90"] = row["shared_bytes"] <= SM90_SHARED_LIMIT
                    rows.append(row)
                    print(_line(row), flush=True)
    write(args.out or OUT, rows, args)


COLUMNS = ("family", "export", "rule", "D", "tiles", "num_warps", "num_stages", "shared_bytes",
           "fits_sm90", "registers", "spill_stores", "cp_async", "tables")


def _line(row: dict) -> str:
    return " | ".join(f"{row[c]:,}" if c == "shared_bytes" else str(row[c]) for c in COLUMNS)


def write(stem: Path, rows: list[dict], args) -> None:
    import triton
    header = {"torch": torch.__version__, "triton": triton.__version__, "target": "cuda sm_90 (no GPU: Triton AOT)",
              "N": args.n, "heads": args.heads, "block": args.block, "density": args.density, "dtype": "bf16",
              "shared-memory limit": SM90_SHARED_LIMIT,
              "export=legacy": "the int32-table export before narrow tables (calibration: on the H200 its forward "
                               "was refused with Required 262,144 B at D 128 and 376,832 B at D 64)"}
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    lines = ["# FlexAttention with `layout.to_flex_block_mask()`: sm_90 kernels at Flex's default tiles", "",
             *(f"- {k}: {v}" for k, v in header.items()), "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + _line(r) + " |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.{{md,json}}")


if __name__ == "__main__":
    main()
