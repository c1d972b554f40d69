"""An NVFP4 ModelOpt checkpoint is served directly: LLM(model=DIR) loads its experts as NVFP4."""
import torch
from quant_fixtures import random_windows, write_model_dir

from namazu import LLM, SamplingParams
from namazu.quant.calibrate import calibrate, finalize
from namazu.quant.modelopt_checkpoint import save_quantized
from namazu.quant.nvfp4_experts import NvFP4Experts
from namazu.quant.quantize import quantize_model
from namazu.quant.selective import QuantPolicy


def _calibrated_checkpoint(tmp_path):
    src, out = tmp_path / "bf16", tmp_path / "nvfp4"
    model = write_model_dir(str(src))
    policy = QuantPolicy.preset("experts")
    cov, lin, total = calibrate(model, random_windows(2, 32), policy, min_tokens=4, progress=False)
    quantize_model(model, policy, finalize(cov, lin, total, 4, True, False)[0])
    save_quantized(model, out, policy, source_dir=src)
    return model, out


def test_llm_serves_a_calibrated_nvfp4_checkpoint(tmp_path):
    model, out = _calibrated_checkpoint(tmp_path)
    with LLM(str(out), executor="inline", dtype="float32") as llm:
        served = llm.engine.executor.worker.runner.model     # the inline executor's model
        res = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(res[0].outputs[0].token_ids) == 6
    experts = [m for m in served.modules() if isinstance(m, NvFP4Experts)]
    assert len(experts) == model.config.num_hidden_layers - model.config.first_k_dense_replace
    assert all(m.nvfp4_mode == "w4a16" and m.w13_packed.dtype == torch.uint8 for m in experts)


def test_nvfp4_mode_flag_selects_w4a4(tmp_path):
    _, out = _calibrated_checkpoint(tmp_path)
    with LLM(str(out), executor="inline", dtype="float32", nvfp4_mode="w4a4", moe_backend="torch") as llm:
        served = llm.engine.executor.worker.runner.model
        res = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(res[0].outputs[0].token_ids) == 4
    experts = [m for m in served.modules() if isinstance(m, NvFP4Experts)]
    assert experts and all(m.nvfp4_mode == "w4a4" for m in experts)
    # The runner resolved both flags once and handed the same runtime to every expert module.
    assert len({id(m.runtime) for m in experts}) == 1 and experts[0].runtime.backend.name == "torch"
