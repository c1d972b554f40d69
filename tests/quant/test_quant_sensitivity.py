"""Sensitivity sweep CLI: one row per module class, each quantizing only that class."""
import json

import pytest
from quant_fixtures import tiny_model, write_model_dir

from namazu.quant import sensitivity


def test_class_weight_shares():
    w = sensitivity.class_weights(tiny_model())
    cfg = tiny_model().config
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert w["routed_experts"] == moe_layers * 3 * cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size
    assert w["router"] == moe_layers * cfg.n_routed_experts * cfg.hidden_size
    assert w["lm_head"] == cfg.vocab_size * cfg.hidden_size


def test_cli_reports_every_class_per_language(tmp_path, capsys):
    src = tmp_path / "m"
    write_model_dir(str(src))
    for lang, text in (("ja", "日本語の文章ですが文字は語彙の外なので未知語になります。" * 3),
                       ("en", "Plain English text for the sensitivity sweep. " * 6)):
        (tmp_path / lang).mkdir()
        (tmp_path / lang / "test.txt").write_text(text)
    out = tmp_path / "s.json"
    rc = sensitivity.main(["--model", str(src), "--calib", str(tmp_path / "en" / "test.txt"),
                           "--data", str(tmp_path / "ja" / "test.txt"), str(tmp_path / "en" / "test.txt"),
                           "--seq-len", "64", "--bootstrap", "20", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    for cls in sensitivity.DEFAULT_CLASSES:
        assert f"| {cls} |" in table
    rows = json.loads(out.read_text())
    assert [r["class"] for r in rows] == list(sensitivity.DEFAULT_CLASSES)
    for r in rows:
        assert [x["label"] for x in r["results"]] == ["ja", "en"] and r["modules"] > 0
        assert all(0 < x["top1_agreement"]["value"] <= 1 and x["mean_kl"]["value"] > 0 for x in r["results"])


def _lang_files(tmp_path):
    for lang, text in (("ja", "日本語の文章です。" * 6), ("en", "Plain English text for the sweep. " * 6)):
        (tmp_path / lang).mkdir()
        (tmp_path / lang / "test.txt").write_text(text)
    return str(tmp_path / "ja" / "test.txt"), str(tmp_path / "en" / "test.txt")


def test_tied_lm_head_is_left_out_of_the_default_sweep_and_refused_when_asked(tmp_path, capsys):
    src = tmp_path / "m"
    write_model_dir(str(src), tie_word_embeddings=True)
    ja, en = _lang_files(tmp_path)
    base = ["--model", str(src), "--calib", en, "--data", ja, "--seq-len", "32", "--bootstrap", "10"]
    with pytest.raises(SystemExit, match="tied to the embeddings"):
        sensitivity.main(base + ["--classes", "router,lm_head"])
    assert sensitivity.main(base) == 0
    table = capsys.readouterr().out
    assert "| lm_head |" not in table and "| routed_experts |" in table
