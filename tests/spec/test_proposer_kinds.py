"""A proposer's kind is checked once, when the worker's speculation is built: what it is (host or device,
with or without a context in the paged cache) decides every call the step makes, and an inconsistent
proposer is refused with the missing part named instead of failing inside a step."""
import re

import pytest
import torch

from namazu.spec.drafters import NgramProposer
from namazu.spec.proposer import Proposal, check_proposer
from namazu.spec.speculator import Speculator


class Device:
    on_device = True
    hidden_layers = (0,)

    def propose(self, inp, k):
        return Proposal(torch.zeros(0, k, dtype=torch.long))


class WithContext(Device):
    draft_seconds = 0.0

    def __init__(self):
        self.attached = None

    def kv_bytes_per_block(self, block_size, dtype):
        return 7 * block_size

    def attach(self, target, num_blocks, block_size):
        self.attached = (num_blocks, block_size)

    def extend_context(self, inp):
        pass


def test_the_kinds_of_the_shipped_proposers():
    assert check_proposer(NgramProposer()) == check_proposer(NgramProposer())
    host = check_proposer(NgramProposer())
    assert not host.on_device and not host.has_context and host.hidden_layers == ()
    dev = check_proposer(Device())
    assert dev.on_device and not dev.has_context and dev.hidden_layers == (0,)
    assert check_proposer(WithContext()).has_context


def test_speculation_calls_a_context_proposers_hooks_and_no_others():
    spec = Speculator(WithContext(), 4, 32, torch.device("cpu"), share_decisions=False, world_size=1)
    assert spec.kv_bytes_per_block(16, torch.float32) == 112 and spec.hidden_layers == (0,)
    spec.attach(torch.nn.Linear(1, 1), 10, 16)
    assert spec.proposer.attached == (10, 16)
    plain = Speculator(Device(), 4, 32, torch.device("cpu"), share_decisions=False, world_size=1)
    assert plain.kv_bytes_per_block(16, torch.float32) == 0 and plain.draft_seconds == 0.0
    plain.attach(torch.nn.Linear(1, 1), 10, 16)     # nothing to attach: no call, no error
    host = Speculator(NgramProposer(), 4, 32, torch.device("cpu"), share_decisions=False, world_size=1)
    assert host.hidden_layers == () and not host.on_device
    none = Speculator(None, 4, 32, torch.device("cpu"), share_decisions=False, world_size=1)
    assert none.k == 0 and none.hidden_layers == ()


class HalfContext(Device):
    def attach(self, target, num_blocks, block_size):
        pass


class HostWithLayers(NgramProposer):
    hidden_layers = (1,)


class NoKind:
    hidden_layers = ()

    def propose(self, inp, k):
        return Proposal([])


@pytest.mark.parametrize("proposer, words", [
    (HalfContext(), "not ['extend_context', 'kv_bytes_per_block']"),
    (HostWithLayers(), "hidden_layers (1,) are only handed to a device proposer"),
    (NoKind(), "on_device must be True"),
    (object(), "has no propose"),
])
def test_an_inconsistent_proposer_is_refused_by_name(proposer, words):
    with pytest.raises(TypeError, match=re.escape(words)):
        Speculator(proposer, 4, 32, torch.device("cpu"), share_decisions=False, world_size=1)
