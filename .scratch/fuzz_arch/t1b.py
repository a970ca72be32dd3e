from harness import *
import torch.nn as nn
m = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 24, batch_first=True)).eval()
opt = fxfuse.optimize(m, torch.randn(2,5,16))
print(fxfuse.explain(opt))
m = nn.Sequential(nn.MultiheadAttention(12, 3, batch_first=True)).eval()
