"""One process of a two-process Accelerate run on CPU (gloo), launched by
test_integration_accelerate.py: prints, as JSON, this process's batches of two epochs with
torch's loader and with the engine, each prepared by Accelerate from the same seed."""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from mprs_plus.integrations import accelerate as integration


class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 26  # not a multiple of 2 processes x 3: Accelerate evens the last batches

    def __getitem__(self, i):
        return torch.tensor([float(i), float(torch.rand(()))])


def epochs(enable: bool) -> tuple[str, list]:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if enable:
        integration.enable()
    try:
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        loader = torch.utils.data.DataLoader(Noisy(), batch_size=3, shuffle=True, num_workers=2)
        prepared = accelerator.prepare(loader)
        return type(prepared.base_dataloader).__module__, [[b.tolist() for b in prepared] for _ in range(2)]
    finally:
        integration.disable()


if __name__ == "__main__":
    theirs, ours = epochs(False), epochs(True)
    state = AcceleratorState()
    print(json.dumps({"process": state.process_index, "processes": state.num_processes, "torch": theirs, "ours": ours}))
    sys.stdout.flush()
