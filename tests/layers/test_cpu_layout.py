"""CPU GEMM layout: a served fp32 CPU model's linear weights are stored K-major, with the same values."""
import torch
from engine_helpers import dense_model, tiny_checkpoint
from torch import nn

from namazu import LLM, SamplingParams
from namazu.layers.cpu_layout import k_major, use_k_major_linears
from namazu.models.loader import load_model


def _linears(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_relayout_keeps_values_and_logits():
    path = tiny_checkpoint()
    ref = dense_model(path)
    model = load_model(path, dtype="float32", progress=False)
    before = {n: w.detach().clone() for n, w in _linears(model).items()}
    n = use_k_major_linears(model)
    after = _linears(model)
    assert n == len(after) > 10
    for name, w in after.items():
        assert w.stride(0) == 1, f"{name} is still row-major"
        assert torch.equal(w, before[name]), name
    assert model.model.embed_tokens.weight.is_contiguous(), "the embedding's rows must stay contiguous"
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        got = model.compute_logits(model(ids)[0])
        want = ref.compute_logits(ref(ids)[0])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tied_embedding_weight_is_left_row_major():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.head = nn.Linear(8, 32, bias=False)
            self.head.weight = self.embed.weight
            self.proj = nn.Linear(8, 8)

    m = Tied()
    assert use_k_major_linears(m) == 1
    assert m.embed.weight.is_contiguous() and m.proj.weight.stride(0) == 1
    w = k_major(torch.randn(4, 3))
    assert w.stride() == (1, 4) and k_major(w) is w


def test_served_cpu_model_is_k_major_and_bf16_is_not():
    path = tiny_checkpoint()
    for dtype, want in (("float32", True), ("bfloat16", False)):
        with LLM(path, executor="inline", dtype=dtype) as llm:
            served = llm.engine.executor.worker.runner.model   # the inline executor's model
            out = llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False,
                               sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        assert all((w.stride(0) == 1) == want for w in _linears(served).values()), dtype
