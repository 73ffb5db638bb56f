"""What a written head computes at draft step 0 for a token sequence, from the folders alone (transformers' target,
the training module's head): the reference the inference engine's EAGLE-3 step 0 is compared against."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.train.draft_head.export import load_head
from tandem.train.draft_head.head import step0_logits
from tandem.train.draft_head.pipeline import target_embed_and_head


@torch.no_grad()
def draft_step0_logits(target: Path, head_folder: Path, token_ids: list[int]) -> torch.Tensor:
    """token_ids x[0..n-1] -> [n - 1, draft_vocab] float32: row t pairs the target's residual streams at position t
    with id x[t+1] at position t (it predicts x[t+2]). Map an argmax d to a target id with d + d2t[d]."""
    import transformers

    head, _, config = load_head(head_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    hidden = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hidden[i][0] for i in config["eagle_aux_hidden_state_layer_ids"]], dim=-1)  # [n, A*H]
    embed, _ = target_embed_and_head(target)
    return step0_logits(head, embed, aux[:-1], ids[0, 1:])
