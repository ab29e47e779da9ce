"""How often a row's k-th key search starts from the narrowed range, on SmolLM2-135M's real
MLP activations (their magnitudes as the scores, 4 windows of 128 WikiText-2 test tokens).

    python scripts/key_search_start.py [DATA_ROOT]

(its output: eval/results/cpu/key-search-start/study.out).

`kernels.top_k.row_kth_key` starts from the NARROW_KEYS keys below a row's largest key when
they hold its k; otherwise it searches the whole key range (exact either way)."""
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dejavu_jax.kernels import top_k
from dejavu_jax.loading import load_pretrained
from dejavu_jax.model import sequence_forward
from dejavu_jax.paths import data_root
from dejavu_jax.fetch_model import fetch
from dejavu_jax.tokenizer import default_tokenizer_for

data = Path(sys.argv[1]) if len(sys.argv) > 1 else data_root()
path = fetch("smollm2-135m")
config, params = load_pretrained(path, progress=False)
text = (data / "eval/wikitext-2/wiki.test.raw").read_text()[:20000]
ids = np.asarray(default_tokenizer_for(config, path).encode(text)[:512]).reshape(4, 128)
_, _, records = sequence_forward(config, params, jnp.asarray(ids), None, records=True)
act = np.asarray(records["mlp_act"], np.float32)[:, :, 1:]         # [L, B, T-1, F]
act = act.reshape(act.shape[0], -1, act.shape[-1])
keys = np.asarray(top_k.score_keys(jnp.asarray(np.abs(act))))
L, N, F = keys.shape
print(f"SmolLM2-135M: {L} layers x {N} tokens, F = {F} (one chunk), NARROW_KEYS = "
      f"{top_k.NARROW_KEYS}")
for frac in (0.1, 0.3, 0.5):
    k = int(round(frac * F))
    top = keys.max(-1)
    narrow = (keys >= np.maximum(top - top_k.NARROW_KEYS, 0)[..., None]).sum(-1) >= k
    per_layer = narrow.mean(1)
    print(f"top {frac:.0%}: the narrowed start holds for {narrow.mean():.1%} of rows "
          f"(layer x token); per layer: lowest {per_layer.min():.0%}, median "
          f"{np.median(per_layer):.0%}")
