"""megatron-core imported through rlbench (rlbench/backends/megatron/model.py, `quiet`): the `torch.compile` its
fused kernels are decorated with at import is deferred to each kernel's first call, so a rank process does not
load TorchInductor's compiler to start; `torch.compile` itself is left as it was. Both ways, each in a fresh
interpreter (the suite's own imports may have loaded TorchInductor already): imported bare, megatron-core loads it,
so an upgrade that stops compiling at import fails here and the deferral can go."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

CODE = """
import sys, warnings
import torch
warnings.simplefilter("ignore")
compile_before = torch.compile
if sys.argv[1] == "rlbench":
    from rlbench.backends.megatron.model import quiet
    with quiet():
        import megatron.core.models.gpt
else:
    import megatron.core.models.gpt
from megatron.core.fusions.fused_bias_geglu import geglu
print(torch.compile is compile_before, "torch._inductor.compile_fx" in sys.modules, geglu.__name__)  # a function
"""


def imported(how: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", CODE, how], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_megatron_core_through_rlbench_defers_torch_compile():
    assert imported("rlbench") == ["True", "False", "geglu"]


def test_megatron_core_imported_bare_loads_torchinductors_compiler():
    assert imported("bare") == ["True", "True", "geglu"]
