"""`training.common.bound_onednn_caches`: torch's caches of oneDNN computations stay small when every training step
brings new row counts; the user's own cache settings win."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.common import ONEDNN_CACHE_ENV, bound_onednn_caches
from vaswani_hf.kernels_vaswani import has_onednn_linear

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import resource, sys
sys.path.insert(0, {root!r})
from training.common import bound_onednn_caches
applied = bound_onednn_caches()
import torch
from vaswani_hf.kernels_vaswani import _onednn_linear
weight, x, grad = torch.randn(2048, 256), torch.randn(600, 256), torch.randn(600, 2048)
_onednn_linear(x, weight), _onednn_linear(grad, weight.t()), _onednn_linear(grad.t(), x.t())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for rows in range(450, 600):  # a linear's forward, input- and weight-gradient products at 150 row counts
    _onednn_linear(x[:rows], weight), _onednn_linear(grad[:rows], weight.t()), _onednn_linear(grad[:rows].t(), x[:rows].t())
print(applied, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def run_probe(**env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_ENV}
    env.update(env_overrides)
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT))], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not has_onednn_linear(), reason="this torch build has no oneDNN linear (not an x86 CPU build), "
                                                    "so there is no oneDNN cache to bound")
def test_onednn_caches_stay_small_with_new_row_counts():
    applied, growth_mib = run_probe()
    assert applied
    # torch's and oneDNN's default capacity, 1,024, set by the user: kept, and every row count's computation kept
    user_applied, user_growth_mib = run_probe(LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024")
    assert not user_applied
    assert user_growth_mib > 2.5 * growth_mib, (growth_mib, user_growth_mib)


def test_user_cache_settings_win(monkeypatch):
    clean = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_ENV}
    for name in ONEDNN_CACHE_ENV:
        monkeypatch.setattr(os, "environ", {**clean, name: "512"})
        assert bound_onednn_caches() is False
        assert {k: os.environ.get(k) for k in ONEDNN_CACHE_ENV} == {k: "512" if k == name else None
                                                                   for k in ONEDNN_CACHE_ENV}
    monkeypatch.setattr(os, "environ", dict(clean))
    assert bound_onednn_caches(capacity=32) is True
    assert os.environ["LRU_CACHE_CAPACITY"] == os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
