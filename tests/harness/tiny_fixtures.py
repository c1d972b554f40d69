"""A miniature corpus in the real corpus' format, so namazu-tiny tests run without the full corpus."""
from __future__ import annotations

from pathlib import Path

JA_DOCS = [
    "名前\nls - ディレクトリの内容をリスト表示する\n書式\nls [OPTION]... [FILE]...\n説明\n"
    "FILE に関する情報を表示する。デフォルトはカレントディレクトリである。エントリはアルファベット順に並べられる。",
    "パッケージの管理\nDebian ではパッケージ管理システムを使ってソフトウェアをインストールします。"
    "依存関係は自動的に解決されます。不要になったパッケージは削除できます。\n"
    "設定ファイル\n設定ファイルは /etc ディレクトリに置かれます。変更する前にバックアップを作成してください。"
    "編集にはテキストエディターを使用します。",
    "表計算の基本\nセルに数値を入力すると、自動的に合計が計算されます。数式は等号から始めます。"
    "関数を使うと複雑な計算も簡単に行えます。\n書式の設定\n書式を設定すると、数値の表示形式を変更できます。"
    "日付や通貨の形式も選択できます。",
]
EN_DOCS = [
    "Package management\nThe Debian package management system installs software together with all of its "
    "dependencies. Packages that are no longer needed can be removed again with a single command.\n"
    "Configuration\nConfiguration files live in the etc directory of the system. Make a backup copy of "
    "every file before you change it in any way.",
    "NAME\nls - list directory contents\nSYNOPSIS\nls [OPTION]... [FILE]...\nDESCRIPTION\nList information "
    "about the FILEs, the current directory by default. Entries are sorted alphabetically by default.",
]


def write_mini_corpus(root: Path, copies: int = 30) -> Path:
    """ja/en train/valid/test files; train repeats the documents `copies` times (varied by a number)."""
    for lang, docs in (("ja", JA_DOCS), ("en", EN_DOCS)):
        (root / lang).mkdir(parents=True, exist_ok=True)
        for split, n in (("train", copies), ("valid", 2), ("test", 2)):
            out = [f"{d}\n{i}" for i in range(n) for d in docs]
            (root / lang / f"{split}.txt").write_text("\n\n<|doc|>\n".join(out) + "\n", encoding="utf-8")
    return root


def small_moe_model():
    """A 2-layer DeepSeek-V3 model (first dense, 8 routed experts) with fixed random weights, fp32."""
    import torch

    from namazu.config import ModelConfig
    from namazu.models.deepseek_v3 import DeepseekV3ForCausalLM

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=64,
                      qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                      num_experts_per_tok=2, max_position_embeddings=128)
    model = DeepseekV3ForCausalLM(cfg, dtype=torch.float32)
    model.init_weights(0)
    return model
