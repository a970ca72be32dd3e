from harness import *
import torch.nn as nn, torch.nn.functional as F, math

class SDPA(nn.Module):
    def __init__(s, d=16, h=2, causal=False):
        super().__init__(); s.qkv = nn.Linear(d, 3*d); s.o = nn.Linear(d, d); s.h = h; s.causal = causal; s.ln = nn.LayerNorm(d)
    def forward(s, x):
        B, T, D = x.shape
        q, k, v = s.qkv(s.ln(x)).chunk(3, dim=-1)
        q = q.view(B, T, s.h, D // s.h).transpose(1, 2)
        k = k.view(B, T, s.h, D // s.h).transpose(1, 2)
        v = v.view(B, T, s.h, D // s.h).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=s.causal)
        return x + s.o(a.transpose(1, 2).reshape(B, T, D))

class ManualAttn(nn.Module):
    def __init__(s, d=12, h=3):
        super().__init__(); s.q = nn.Linear(d, d); s.k = nn.Linear(d, d); s.v = nn.Linear(d, d); s.h = h
        s.register_buffer("mask", torch.tril(torch.ones(16, 16)).bool())
    def forward(s, x):
        B, T, D = x.shape
        hd = D // s.h
        q = s.q(x).reshape(B, T, s.h, hd).permute(0, 2, 1, 3)
        k = s.k(x).reshape(B, T, s.h, hd).permute(0, 2, 3, 1)
        v = s.v(x).reshape(B, T, s.h, hd).permute(0, 2, 1, 3)
        att = (q @ k) / math.sqrt(hd)
        att = att.masked_fill(~s.mask[:T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        return (att @ v).permute(0, 2, 1, 3).flatten(2)

class MHA(nn.Module):
    def __init__(s, d=12, h=3, bf=True):
        super().__init__(); s.m = nn.MultiheadAttention(d, h, batch_first=bf); s.bf = bf; s.ln = nn.LayerNorm(d)
    def forward(s, x):
        y, w = s.m(x, x, x, need_weights=True)
        return s.ln(x + y), w

class MHAMask(nn.Module):
    def __init__(s, d=12, h=2):
        super().__init__(); s.m = nn.MultiheadAttention(d, h, batch_first=True)
    def forward(s, x):
        T = x.shape[1]
        mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
        y, _ = s.m(x, x, x, attn_mask=mask, need_weights=False)
        return y

class SoftDims(nn.Module):
    def forward(s, x):
        return F.softmax(x, 0) + F.softmax(x, 1) * 2 + F.log_softmax(x, -1) + torch.softmax(x, dim=2).exp()

class TEL(nn.Module):
    def __init__(s, bf=True, norm_first=False):
        super().__init__(); s.l = nn.TransformerEncoderLayer(16, 2, 24, dropout=0.1, batch_first=bf, norm_first=norm_first)
    def forward(s, x):
        return s.l(x)

check("sdpa", SDPA(), lambda b: (torch.randn(b, 5, 16),), linear=True)
check("sdpa_causal", SDPA(causal=True), lambda b: (torch.randn(b, 6, 16),), linear=True)
check("manual_attn_causal", ManualAttn(), lambda b: (torch.randn(b, 7, 12),), linear=True)
check("mha_bf", MHA(), lambda b: (torch.randn(b, 5, 12),))
check("mha_seqfirst", MHA(bf=False), lambda b: (torch.randn(5, b, 12),))
check("mha_mask", MHAMask(), lambda b: (torch.randn(b, 6, 12),))
check("softmax_dims", SoftDims(), lambda b: (torch.randn(b, 4, 5),))
check("tel_bf", TEL(), lambda b: (torch.randn(b, 5, 16),))
check("tel_sf_normfirst", TEL(bf=False, norm_first=True), lambda b: (torch.randn(5, b, 16),))
