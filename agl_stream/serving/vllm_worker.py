"""Runs inside vLLM's worker process (`--worker-extension-cls`), called through the server's
`/collective_rpc`: a reload of the weights from a checkpoint directory that also rebuilds a
tied output layer. Imports nothing of agl-stream's, so the worker loads only this file.

vLLM's in-place reload loads each checkpoint tensor into the layer that owns it. With tied
input and output embeddings the checkpoint has no `lm_head.weight`, so the output layer
loads nothing and is put back as it was: the old weights, and on CPUs the old packed copy
its matrix product uses. The model then answers with neither the old nor the new weights.
Tying the layer to the reloaded embedding again and repeating its post-load processing (the
packing) makes it the new checkpoint's.
"""

from __future__ import annotations

from typing import Any


class WeightReload:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def agl_reload_weights(self, weights_path: str) -> None:
        worker: Any = self
        worker.reload_weights(weights_path=weights_path)
        retie_output_layer(worker.model_runner.get_model())


def retie_output_layer(model: Any) -> None:
    """After a reload: the output layer shares the input embedding's weight again, and its
    kernel state is rebuilt from it. Models with untied embeddings are left as they are."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        raise RuntimeError(
            f"{type(model).__name__} ties its embeddings but has no lm_head and "
            "model.embed_tokens to tie again after a reload"
        )
    head = getattr(head, "base_layer", head)  # LoRA wraps layers; the weight is inside
    embed = getattr(embed, "base_layer", embed)
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)
