"""Issue #16's AMX goal, the part a CPU without AMX can check: which kernel every bf16 matmul of
a training step runs on.

On an AVX2 EPYC the backward's transposed bf16 matmuls fell to torch's scalar fallback GEMM
(``cpublas::gemm_transb_impl``), ~30x slower than fp32. Where the CPU has native bf16 (AMX or
AVX512-BF16) torch hands bf16 GEMMs to oneDNN, whose kernels use AMX tiles where they exist; so
the property that makes bf16 fast on an AMX CPU is "every bf16 matmul of the step is a oneDNN
primitive, whatever its layout". This test observes it: a fresh process runs one packed bf16 SFT
step (decoder forward, the fused head's eager gradients, backward) with ``ONEDNN_VERBOSE=all``
and a dispatch mode recording the bf16 ``mm``/``addmm``/``bmm`` calls, and every one of them must
appear, with its shapes, among the oneDNN ``exec`` lines printed for matmul primitives between
two markers. On a CPU without
native bf16 the test checks what the run does instead: ``auto`` trains in fp32 there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

from grimoire.model import precision

SCRIPT = r"""
import ctypes, json, os, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from grimoire.losses import SFTLoss
from grimoire.model.tiny import build_model

torch.set_num_threads(1)
libc = ctypes.CDLL(None)

def mark(text):  # oneDNN prints through C stdio: flush it so the markers keep their place
    libc.fflush(None)
    os.write(1, (text + "\n").encode())

MM = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.mm.out"}

class CountBf16Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in MM and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args
        ):
            a, b = [t for t in args if isinstance(t, torch.Tensor)][-2:]  # (addmm: bias first)
            # oneDNN's problem descriptor for the same product: "MxK:KxN" ("BxMxK:BxKxN").
            self.calls.append("x".join(map(str, a.shape)) + ":" + "x".join(map(str, b.shape)))
        return func(*args, **(kwargs or {}))

model = build_model("llama", vocab_size=512, hidden_size=64, num_layers=2).train()
# Two packed samples (position_ids restart), the first token of each a prompt.
ids = torch.randint(3, 512, (1, 24), generator=torch.Generator().manual_seed(0))
labels = ids.clone()
labels[0, 0] = labels[0, 10] = -100
batch = {"input_ids": ids, "labels": labels,
         "position_ids": torch.cat([torch.arange(10), torch.arange(14)])[None]}
loss_fn = SFTLoss()
with torch.autocast("cpu", dtype=torch.bfloat16):  # warm-up: oneDNN builds its kernels
    loss_fn(model, batch)[0].backward()
model.zero_grad()
counter = CountBf16Matmuls()
mark("GRIMOIRE-START")
with counter, torch.autocast("cpu", dtype=torch.bfloat16):
    loss, _ = loss_fn(model, batch)
    loss.backward()
mark("GRIMOIRE-END")
print(json.dumps({"calls": counter.calls}), flush=True)
"""


def test_every_bf16_matmul_of_a_step_runs_in_onednn_where_bf16_is_native():
    detected = precision.detect_cpu_bf16()
    if not detected.native:
        # The fast kernels are not there: auto must not choose bf16 (see test_precision.py for
        # the warning an explicit bf16 gets).
        assert precision.decide("auto", cuda=False)[0] == "no", detected
        return
    env = {**os.environ, "ONEDNN_VERBOSE": "all", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    start, end = lines.index("GRIMOIRE-START"), lines.index("GRIMOIRE-END")
    step = lines[start + 1 : end]
    calls = json.loads(next(ln for ln in lines if ln.startswith('{"calls"')))["calls"]
    execs = [ln.split(",") for ln in step if ",primitive,exec,cpu,matmul," in ln]
    kernels = sorted({fields[6] for fields in execs})
    # Forward (q/k/v/o, gate/up/down per layer), head (logits, dL/dhidden, dL/dW) and the
    # backward's two transposed products per decoder linear: dozens of calls.
    assert len(calls) >= 3 * 7 * 2, calls
    # Every one of them, by shape, among oneDNN's executions (which also hold the GEMMs inside
    # the CPU flash-attention kernel, so there are more executions than calls).
    missing = Counter(calls) - Counter(fields[-2] for fields in execs)
    assert not missing, (missing, kernels)
    # oneDNN's own bf16 kernels (avx512_core_bf16 here; avx512_core_amx on an AMX CPU), never
    # its reference implementation.
    assert kernels and all("bf16" in k or "amx" in k for k in kernels), kernels
