"""VSRN's model (Li et al. 2019; DUET Table 1's second baseline) against a transcription of its
authors' modules (KunpengLi1994/VSRN: ``GCN_lib/Rs_GCN.py``'s kernel-1 convolutions and BatchNorm1d
over (B, D, N), ``model.py``'s ``EncoderImagePrecompAttn`` and ``l2norm``, ``models/EncoderRNN.py``,
``DecoderRNN.py``, ``Attention.py`` in training mode), written here as that code reads, with the
weights copied over; then what padding must not change, and gradients.

Every test runs on each device of the ``device`` fixture; the transcriptions run on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmcse.models.vsrn import VsrnArchitecture, VsrnModel

D, REGION_DIM, VOCAB = 6, 5, 13


def _model(device: torch.device, **kwargs) -> VsrnModel:
    torch.manual_seed(0)
    args = {"vocab_size": VOCAB, "region_dim": REGION_DIM, "word_dim": 4, "joint_dim": D, "gcn_layers": 2,
            "caption_hidden": 7, "caption_word_dim": 3, "caption_dropout": 0.0} | kwargs
    model = VsrnModel(VsrnArchitecture(**args)).double()
    for layer in model.gcn:  # the code starts BN at 0 (every layer the identity): non-zero, so R matters here
        nn.init.normal_(layer.bn.weight)
        nn.init.normal_(layer.bn.bias)
    return model.to(device)


def code_l2norm(X: torch.Tensor) -> torch.Tensor:
    """model.py's l2norm: the norm over dim 1, whatever the tensor."""
    return X / X.pow(2).sum(dim=1, keepdim=True).sqrt()


class CodeRsGCN(nn.Module):
    """GCN_lib/Rs_GCN.py's forward on v (B, D, N), with the convolutions' weights given."""

    def __init__(self, layer) -> None:
        super().__init__()
        conv = {}
        for name in ("g", "theta", "phi", "W"):
            lin = getattr(layer, name)
            c = nn.Conv1d(lin.in_features, lin.out_features, 1).double()
            c.weight.data = lin.weight.detach().cpu().clone().unsqueeze(-1)
            c.bias.data = lin.bias.detach().cpu().clone()
            conv[name] = c
        self.g, self.theta, self.phi = conv["g"], conv["theta"], conv["phi"]
        self.bn = nn.BatchNorm1d(layer.bn.num_features).double()
        self.bn.load_state_dict({k: v.detach().cpu().clone() for k, v in layer.bn.state_dict().items()})
        self.W = nn.Sequential(conv["W"], self.bn)
        self.inter = conv["g"].out_channels

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        B = v.size(0)
        g_v = self.g(v).view(B, self.inter, -1).permute(0, 2, 1)
        theta_v = self.theta(v).view(B, self.inter, -1).permute(0, 2, 1)
        phi_v = self.phi(v).view(B, self.inter, -1)
        R = torch.matmul(theta_v, phi_v)
        R_div_C = R / R.size(-1)
        y = torch.matmul(R_div_C, g_v).permute(0, 2, 1).contiguous().view(B, self.inter, *v.size()[2:])
        return self.W(y) + v


def code_image_encoder(model: VsrnModel, images: torch.Tensor, training: bool, variant: str):
    """EncoderImagePrecompAttn.forward: (features (B, D), GCN_img_emd (B, N, D)), and the GCN copies."""
    gcns = [CodeRsGCN(layer).train(training) for layer in model.gcn]
    fc_img_emd = F.linear(images, model.image_fc.weight.detach().cpu(), model.image_fc.bias.detach().cpu())
    if variant != "flickr30k":
        fc_img_emd = code_l2norm(fc_img_emd)
    gcn = fc_img_emd.permute(0, 2, 1)
    for layer in gcns:
        gcn = layer(gcn)
    gcn = code_l2norm(gcn.permute(0, 2, 1))
    rnn = nn.GRU(D, D, 1, batch_first=True).double()
    rnn.load_state_dict({k: v.detach().cpu() for k, v in model.region_gru.state_dict().items()})
    _, hidden_state = rnn(gcn)
    features = hidden_state[0]
    if variant == "flickr30k":
        bn = nn.BatchNorm1d(D).double().train(training)
        bn.load_state_dict({k: v.detach().cpu().clone() for k, v in model.image_bn.state_dict().items()})
        features = bn(features)
    return code_l2norm(features), gcn, gcns


@pytest.mark.parametrize("variant", ["coco", "flickr30k"])
@pytest.mark.parametrize("training", [True, False])
def test_image_side_is_the_authors_encoder_on_full_region_sets(device, variant, training):
    """BUTD's 36 regions never pad: there v_I, the reasoned regions and the BatchNorms' running
    statistics are the code's, in training (batch statistics) and evaluation (running ones)."""
    model = _model(device, variant=variant).train(training)
    torch.manual_seed(1)
    images = torch.randn(4, 5, REGION_DIM, dtype=torch.float64)
    expected, expected_regions, gcns = code_image_encoder(model, images, training, variant)
    v, reasoned = model.encode_image(images.to(device))
    torch.testing.assert_close(v.cpu(), expected)
    torch.testing.assert_close(reasoned.cpu(), expected_regions)
    for mine, code in zip(model.gcn, gcns, strict=True):  # the running statistics moved alike
        torch.testing.assert_close(mine.bn.running_mean.cpu(), code.bn.running_mean)
        torch.testing.assert_close(mine.bn.running_var.cpu(), code.bn.running_var)


def test_a_fresh_gcn_is_the_identity():
    """The code zero-initialises each Rs_GCN's BatchNorm: v* = v until training moves it."""
    model = VsrnModel(VsrnArchitecture(VOCAB, REGION_DIM, word_dim=4, joint_dim=D, gcn_layers=3)).double()
    v = torch.randn(2, 4, D, dtype=torch.float64)
    keep = torch.ones(2, 4, 1, dtype=torch.float64)
    for layer in model.gcn:
        torch.testing.assert_close(layer(v, keep, None), v)


def test_padding_changes_nothing_in_training_or_evaluation(device):
    """An image with k of n slots real: its v_I is the unpadded image's, whatever the padding holds,
    and the BatchNorm statistics are the real regions' alone."""
    torch.manual_seed(2)
    images = torch.randn(3, 5, REGION_DIM, dtype=torch.float64)
    counts = [5, 3, 2]
    mask = torch.arange(5)[None, :] < torch.tensor(counts)[:, None]
    noisy = torch.where(mask[..., None], images, torch.randn_like(images) * 100)
    # evaluation: each image scores as it would alone, unpadded
    model = _model(device).eval()
    v, reasoned = model.encode_image(noisy.to(device), None, mask.to(device))
    assert not reasoned.cpu()[~mask].any()
    for i, k in enumerate(counts):
        alone, _ = model.encode_image(images[i : i + 1, :k].to(device))
        torch.testing.assert_close(v[i : i + 1].cpu(), alone.cpu())
    # training: one image padded is the same image unpadded, statistics included
    a, b = _model(device).train(), _model(device).train()
    va, _ = a.encode_image(noisy[1:2].to(device), None, mask[1:2].to(device))
    vb, _ = b.encode_image(images[1:2, :3].to(device))
    torch.testing.assert_close(va, vb)
    for la, lb in zip(a.gcn, b.gcn, strict=True):
        torch.testing.assert_close(la.bn.running_var, lb.bn.running_var)
    with pytest.raises(ValueError, match="without regions"):
        a.encode_image(images[:1].to(device), None, torch.zeros(1, 5, dtype=torch.bool, device=device))


@pytest.mark.parametrize("region_l2", ["regions", "features"])
def test_region_l2_runs_over_the_axis_it_names(device, region_l2):
    model = _model(device, region_l2=region_l2).eval()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool, device=device)
    _, reasoned = model.encode_image(torch.randn(2, 4, REGION_DIM, dtype=torch.float64, device=device), None, mask)
    if region_l2 == "regions":  # each channel a unit vector across the image's real regions
        torch.testing.assert_close(reasoned.norm(dim=1), torch.ones(2, D, dtype=torch.float64, device=device))
    else:  # each real region a unit vector
        torch.testing.assert_close(reasoned.norm(dim=-1)[mask], torch.ones(6, dtype=torch.float64, device=device))


def code_caption_logprobs(model: VsrnModel, feats: torch.Tensor, targets: torch.Tensor, max_len: int) -> torch.Tensor:
    """S2VTAttModel(EncoderRNN, DecoderRNN) in 'train' mode, dropout off: seq_logprobs (B, max_len - 1, V)."""
    c = model.captioner
    W = {k: v.detach().cpu() for k, v in c.state_dict().items()}
    B, N, dim_vid = feats.shape
    H = c.region_in.out_features
    enc = nn.GRU(H, H, 1, batch_first=True).double()
    enc.load_state_dict({k.removeprefix("encoder."): v for k, v in W.items() if k.startswith("encoder.")})
    dec = nn.GRU(c.decoder.input_size, H, 1, batch_first=True).double()
    dec.load_state_dict({k.removeprefix("decoder."): v for k, v in W.items() if k.startswith("decoder.")})
    vid = F.linear(feats.reshape(-1, dim_vid), W["region_in.weight"], W["region_in.bias"]).view(B, N, H)
    encoder_outputs, decoder_hidden = enc(vid)
    targets_emb = F.embedding(targets, W["embed.weight"])
    seq = []
    for i in range(max_len - 1):
        current_words = targets_emb[:, i, :]
        hidden = decoder_hidden.squeeze(0).unsqueeze(1).repeat(1, N, 1)
        inputs = torch.cat((encoder_outputs, hidden), 2).view(-1, H * 2)
        o = F.linear(torch.tanh(F.linear(inputs, W["attend.weight"], W["attend.bias"])), W["score.weight"])
        alpha = F.softmax(o.view(B, N), dim=1)
        context = torch.bmm(alpha.unsqueeze(1), encoder_outputs).squeeze(1)
        decoder_input = torch.cat([current_words, context], dim=1).unsqueeze(1)
        decoder_output, decoder_hidden = dec(decoder_input, decoder_hidden)
        seq.append(F.log_softmax(F.linear(decoder_output.squeeze(1), W["out.weight"], W["out.bias"]), dim=1))
    return torch.stack(seq, 1)


def test_caption_generator_is_the_authors_s2vt_attention_model(device):
    """Teacher-forced over the same words, the generator's next-word distributions are the code's."""
    model = _model(device).eval()
    torch.manual_seed(3)
    feats = torch.randn(3, 4, D, dtype=torch.float64)
    max_len = 6
    targets = torch.randint(0, VOCAB, (3, max_len + 1))
    expected = code_caption_logprobs(model, feats, targets, max_len)
    mask = torch.ones(3, 4, dtype=torch.bool, device=device)
    logits = model.caption_logits(feats.to(device), mask, targets[:, : max_len - 1].to(device))
    torch.testing.assert_close(torch.log_softmax(logits, -1).cpu(), expected)
    # padded regions: the attention and the encoder read the real ones alone
    noisy = torch.cat([feats, torch.randn(3, 2, D, dtype=torch.float64) * 50], 1).to(device)
    padded = torch.cat([mask, torch.zeros(3, 2, dtype=torch.bool, device=device)], 1)
    torch.testing.assert_close(model.caption_logits(noisy, padded, targets[:, : max_len - 1].to(device)), logits)


def test_gradients_of_the_whole_objective_match_finite_differences(device):
    from mmcse.methods.vsrn import caption_targets, vsrn_objective

    model = _model(device).train()
    ids = torch.tensor([[1, 5, 7, 2, 0], [1, 4, 2, 0, 0], [1, 3, 8, 9, 2]], device=device)
    attention = (torch.arange(5, device=device)[None] < torch.tensor([4, 3, 5], device=device)[:, None]).long()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool, device=device)
    torch.manual_seed(4)
    regions = torch.randn(3, 3, REGION_DIM, dtype=torch.float64, device=device)

    def loss_of(r: torch.Tensor) -> torch.Tensor:
        v, reasoned = model.encode_image(r, None, mask)
        inputs, targets, counted = caption_targets(ids, attention, 60, 2)
        return vsrn_objective(v, model.encode_text(ids, attention), model.caption_logits(reasoned, mask, inputs),
                              targets, counted, margin=0.5)["loss"]

    loss_of(regions).backward()
    for name in ("embed.weight", "gru.weight_ih_l0", "image_fc.weight", "gcn.0.theta.weight", "gcn.1.bn.weight",
                 "region_gru.weight_hh_l0", "captioner.attend.weight", "captioner.out.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert torch.autograd.gradcheck(loss_of, (regions.clone().requires_grad_(),), eps=1e-6, atol=1e-5)
