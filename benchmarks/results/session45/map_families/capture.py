import sys, time, torch
sys.path.insert(0, "/tmp/overcomplete")
torch.set_num_threads(2)
from common import *
t = time.time()
model, tok = carrier_model()
LAYERS = [2, 8, 13, 18, 23, 28]
train, held = windows(tok, 0, 8), windows(tok, 1, 4)
print("windows", train.shape, held.shape, time.time() - t, flush=True)
data = {"layers": LAYERS, "train": capture(model, train, LAYERS), "held": capture(model, held, LAYERS)}
torch.save(data, "/tmp/overcomplete/cap.pt")
print("done", time.time() - t)
