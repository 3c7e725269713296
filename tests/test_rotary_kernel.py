"""The Triton rotary pass (`jfa.kernels.rotary`) in Triton's interpreter, against `jfa.reference`.

The interpreter is chosen when `triton.jit` decorates a kernel, so the check runs in a child process
started with TRITON_INTERPRET=1; the argument checks need no kernel and run here.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from jfa.kernels import rotary

REPO_ROOT = Path(__file__).resolve().parent.parent

INTERPRETED_CHECK = textwrap.dedent("""
    import torch
    from jfa import reference
    from jfa.kernels import rotary

    torch.manual_seed(0)
    offsets = torch.tensor([0, 1, 34, 34, 97], dtype=torch.int32)  # includes an empty sequence
    rows = int(offsets[-1])
    for head_dim in (64, 128):
        sinu_pos = reference.make_sinu_pos(offsets, head_dim)
        # A column slice of a projection output: row stride 7 heads, 3 heads rotated.
        qkv = torch.randn(rows, 7 * head_dim)
        src = qkv[:, head_dim:4 * head_dim].view(rows, 3, head_dim)
        for conjugate, ref in ((False, reference.rotary_ref), (True, reference.rotary_conj_ref)):
            got = rotary.rotate(src, sinu_pos, conjugate=conjugate)
            torch.testing.assert_close(got, ref(src, sinu_pos), rtol=1e-6, atol=1e-6)
        # conjugate undoes the rotation
        torch.testing.assert_close(rotary.rotate(rotary.rotate(src, sinu_pos), sinu_pos, conjugate=True), src,
                                   rtol=1e-5, atol=1e-5)
        grads = tuple(torch.randn(rows, h, head_dim) for h in (4, 2, 2))
        dz = rotary.rotary_conj_dz(grads, sinu_pos)
        expected = torch.cat([reference.rotary_conj_ref(g, sinu_pos).flatten(1) for g in grads], dim=1)
        torch.testing.assert_close(dz, expected, rtol=1e-6, atol=1e-6)
    print("rotary interpreted: ok")
""")


def test_rotary_pass_matches_the_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", INTERPRETED_CHECK], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rotary interpreted: ok" in done.stdout


@pytest.mark.parametrize("make_args, message", [
    (lambda: (torch.zeros(4, 2, 63), torch.zeros(4, 63)), "head_dim must be even"),
    (lambda: (torch.zeros(4, 2, 64), torch.zeros(5, 64)), "sinu_pos must be [M, D] = [4, 64]"),
    (lambda: (torch.zeros(4, 64, 2).transpose(1, 2), torch.zeros(4, 64)), "src: each row's values must be contiguous"),
])
def test_bad_arguments_name_the_argument(make_args, message):
    src, sinu_pos = make_args()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        rotary.rotate(src, sinu_pos)


def test_out_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="out must have src's shape"):
        rotary.rotate(torch.zeros(4, 2, 64), torch.zeros(4, 64), out=torch.zeros(4, 3, 64))
