"""The ``kdtree`` attention backend (kernels/kdtree/kdtree_ext/backend.py) on the REAL sglang 0.5.23 code, on CPU:
SGLang's own ``AttentionBackend.forward`` -> ``TritonAttnBackend.forward_extend`` runs a target-verify batch,
writes the draft KV into a real ``MLATokenToKVPool`` and calls its extend kernel — which the kdtree backend
routes to the kdtree kernel (Triton interpreter, float32). Every other mode stays SGLang's.
See tests/kernels/backend_check.py for how the backend object is built without a GPU model runner.
"""

from __future__ import annotations

import pytest

from tests.kernels.conftest import Script, run_script


@pytest.fixture(scope="module")
def checks(sglang_python: str) -> dict[str, dict]:
    run: Script = run_script(sglang_python, "backend_check.py")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = {}
    for line in run.stdout.splitlines():
        if line.startswith("CHECK "):
            import json

            item = json.loads(line[6:])
            found[item.pop("name")] = item
    assert len(found) == run.result["checks"] == 7
    built = [line for line in run.stdout.splitlines() if line.startswith("[kdtree] verify backend built:")]
    assert built and "kernel=kdtree-splitk nsplit=8 wraps=TritonAttnBackend hooked=True" in built[0]
    return found


def test_factory_wraps_sglangs_triton_backend(checks):
    f = checks["factory"]
    assert f == {"type": "KdtreeVerifyBackend", "hooked": True, "nsplit": 8, "page_size": 1, "inner_is_triton": True}


def test_target_verify_tree_runs_the_kdtree_kernel_through_sglangs_forward(checks):
    v = checks["verify_tree"]
    assert v["calls"] == 1 and v["fallbacks"] == 0, v
    assert v["kv_written_by_sglang"]                # SGLang's forward_extend still saved the draft KV
    assert v["max_err"] < 1e-5 and v["ref_max"] > 0.1
    assert v["workspace_slots"] > 0
    s = checks["sglang_extend_tree"]                # SGLang's extend_attention_fwd on the same batch agrees
    assert s["max_err"] < 1e-5 and s["vs_kdtree"] < 1e-5


def test_chain_matches_sglangs_extend_and_verify_mla(checks):
    c = checks["verify_chain"]
    assert c["calls"] == 1 and c["max_err"] < 1e-5 and c["vs_sglang"] < 1e-5
    vm = c["verify_mla"]
    assert vm.get("ran"), vm
    # verify_mla keeps its per-split partial outputs in bf16 (its att_out buffer): ~2^-8 relative
    assert vm["err"] < 3e-2 and vm["vs_kdtree"] < 3e-2


def test_other_modes_stay_sglangs(checks):
    o = checks["other_modes"]
    assert o["extend_calls"] == 0 and o["extend_err"] < 1e-5
    assert o["decode_result"] == "decoded" and o["decode_calls"] == 1 and o["verify_calls_unchanged"]


def test_unsupported_arguments_fall_back_to_sglangs_kernel(checks):
    f = checks["fallback"]
    assert f["calls"] == 0 and f["fallbacks"] == 1 and f["why"] == "logit_cap=30.0" and f["finite"]
    assert f["non_mla_taken"] is False


def test_attributes_delegate_and_graph_state_reserves_the_workspace(checks):
    d = checks["delegation"]
    assert d["inner_metadata_cleared"] and d["inner_init_called"]
    assert d["workspace_rows"] == 6 * 4 and d["workspace_slots"] == d["expected_slots"]
