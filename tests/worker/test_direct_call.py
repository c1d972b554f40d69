"""A compiled graph called directly (`worker/direct_call.py`): the recorded argument list with the per-call
tensors and the width replaced gives what a call through torch.compile gives, for new values of every
per-call input (a direct call that kept one at its recorded value fails here: tests/MUTATIONS.md H5, DC1);
a recording it cannot replay unambiguously is refused. Traced with the "eager" backend, as the other
graph-mode tests are."""
import torch

from namazu.worker.direct_call import DirectCall, GraphRecorder
from namazu.worker.graph_mode import compile_backend


def _step(weights, x: torch.Tensor, table: torch.Tensor, cache: torch.Tensor):
    cache.index_put_((table[:, 0],), x[: table.shape[0]])            # an input mutation, as the tail's write
    y = (x @ weights["w"]).sum(-1)
    return y + table.sum(1)[:1], None, table.float().mean() * table.shape[1]


def _compiled():
    recorder = GraphRecorder(compile_backend("eager"))
    return recorder, torch.compile(_step, backend=recorder, dynamic=False, fullgraph=True)


def test_a_direct_call_replays_the_traced_call_for_new_per_call_inputs_and_widths():
    weights = {"w": torch.randn(4, 3)}
    buf = torch.arange(16).view(2, 8)
    cache = torch.zeros(16, 4)
    recorder, fn = _compiled()
    x, table = torch.randn(2, 4), buf[:, :2]
    torch._dynamo.mark_dynamic(table, 1, min=2, max=8)
    with recorder.record():
        ref = fn(weights, x, table, cache)
    direct = DirectCall.learn(recorder.last, {"x": x, "table": table}, 2, ref)
    assert direct is not None and direct.nones == [False, True, False]
    for width in (2, 4, 8):
        x2, table2 = torch.randn(2, 4), buf[:, :width]
        want_cache = cache.clone()
        want = _step(weights, x2, table2, want_cache)
        got = direct({"x": x2, "table": table2}, width)
        assert got[1] is None
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[2], want[2])        # the width reached the graph's symbolic size
        torch.testing.assert_close(cache, want_cache)       # the mutation went to the cache itself


def test_a_recording_with_one_tensor_under_two_names_or_without_the_width_is_refused():
    weights = {"w": torch.randn(4, 3)}
    buf = torch.arange(16).view(2, 8)
    recorder, fn = _compiled()
    x, table = torch.randn(2, 4), buf[:, :2]
    torch._dynamo.mark_dynamic(table, 1, min=2, max=8)
    with recorder.record():
        ref = fn(weights, x, table, torch.zeros(16, 4))
    assert DirectCall.learn(recorder.last, {"x": x, "also_x": x, "table": table}, 2, ref) is None
    assert DirectCall.learn(recorder.last, {"x": x, "table": table}, 3, ref) is None     # no symbolic int held 3
    assert DirectCall.learn(None, {"x": x}, 2, ref) is None                            # nothing recorded
