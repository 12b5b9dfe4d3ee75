"""The alignment heads' cross-attention (models/whisper.py ``cross_attention_weights``): the alignment pass runs the
decoder by the calibration's own code, with fused attention, and recomputes the weights of the alignment heads from
the cross-attention's query input. They must be the weights the model's eager attention returns for those heads."""
from __future__ import annotations

import pytest
import torch

from tarq_deploy.models.whisper import cross_attention_weights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_alignment_head_weights_are_the_eager_attention_weights(tiny):
    model, _, generation_config = tiny
    generator = torch.Generator().manual_seed(0)
    encoded = torch.randn(1, 1500, model.config.d_model, generator=generator)
    ids = torch.randint(0, 50000, (1, 23), generator=generator)
    decoder = model.model.decoder
    queries: dict[int, torch.Tensor] = {}
    def keep_query_input(index: int):
        return lambda _module, args: queries.__setitem__(index, args[0].reshape(-1, args[0].shape[-1]))

    handles = [layer.encoder_attn.q_proj.register_forward_pre_hook(keep_query_input(index))
               for index, layer in enumerate(decoder.layers)]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = decoder(input_ids=ids, encoder_hidden_states=encoded, output_attentions=True, use_cache=False)
            heads = [tuple(pair) for pair in generation_config.alignment_heads]
            assert heads
            for layer, head in heads:
                ours = cross_attention_weights(decoder.layers[layer].encoder_attn, queries[layer], encoded, [head])[0]
                eager = out.cross_attentions[layer][0, head]
                assert ours.shape == eager.shape == (23, 1500)
                torch.testing.assert_close(ours, eager, rtol=0, atol=1e-6)
                # a wrong head is far from it: the check can fail
                other = cross_attention_weights(decoder.layers[layer].encoder_attn, queries[layer], encoded,
                                                [(head + 1) % decoder.layers[layer].encoder_attn.num_heads])[0]
                assert (other - eager).abs().max() > 1e-3
    finally:
        model.set_attn_implementation(previous)
        for handle in handles:
            handle.remove()
