"""Saguaro cache keys (drafting/saguaro.py): candidates per accepted length, the rejected draft excluded,
lookups, residual scaling."""
import pytest
import torch

from ssmspec.drafting.saguaro import bonus_candidates, branch_depths, cache_lookup, check_fanout, rescale_top


def test_candidates_exclude_the_rejected_draft_and_follow_the_fanout():
    torch.manual_seed(0)
    B, S, V = 3, 3, 11
    logits = torch.randn(B, S + 1, V)
    drafts = logits[:, :S].argmax(-1)  # greedy drafts: the draft's best token is the rejected one at k < S
    fan = (3, 2, 1, 2)
    keys = bonus_candidates(logits, drafts, fan)
    depths = branch_depths(fan)
    assert keys.shape == (B, sum(fan)) and depths.tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    for b in range(B):
        for k in range(S + 1):
            row = logits[b, k].clone()
            if k < S:
                row[drafts[b, k]] = float("-inf")
            want = row.topk(fan[k]).indices.tolist()
            assert keys[b][depths == k].tolist() == want
            if k < S:
                assert int(drafts[b, k]) not in keys[b][depths == k].tolist()


def test_lookup_hits_only_the_branch_of_the_verdict():
    keys = torch.tensor([[5, 6, 7, 5], [1, 2, 3, 4]])
    depths = torch.tensor([0, 0, 1, 1])
    hit, branch = cache_lookup(keys, depths, accepted=torch.tensor([1, 0]), bonus=torch.tensor([5, 3]))
    assert hit.tolist() == [True, False]  # row 1: token 3 is cached, but at accepted length 1, not 0
    assert branch[0].item() == 3


@pytest.mark.parametrize("fan,msg", [((1, 1), "one count per accepted length"), ((0, 0, 0), "cannot hold one"),
                                     ((1, -1, 1), "cannot hold one")])
def test_bad_fanout_is_one_clear_error(fan, msg):
    with pytest.raises(ValueError, match=msg):
        check_fanout(fan, 2)


def test_rescale_top_moves_mass_off_the_top_tokens_and_keeps_a_law():
    p = torch.softmax(torch.randn(4, 9), -1)
    q = rescale_top(p, 0.5, 2)
    assert torch.allclose(q.sum(-1), torch.ones(4))
    top = p.topk(2, -1).indices
    assert (q.gather(-1, top) < p.gather(-1, top)).all()
    assert torch.equal(rescale_top(p, 1.0, 2), p)
    with pytest.raises(ValueError, match="lambda must lie in"):
        rescale_top(p, 1.5, 2)
