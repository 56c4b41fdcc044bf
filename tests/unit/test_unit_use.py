"""What reads a unit decides its release: one state (UnitUse) changed through one table
(issue #30 item 1). The engine tests check the behaviour end to end (units released after their
forward and backward, held through recomputation, LoRA units kept until their inputs' gradient);
these walk the record through the hook sequences that lead there."""

from __future__ import annotations

import pytest

from infinity.errors import IllegalTransitionError
from infinity.zero._flat_group import USE_TRANSITIONS, Unit, UnitUse


def _unit(*, trainable: int = 2, frozen: bool = False, use: UnitUse = UnitUse.IDLE) -> Unit:
    return Unit(index=1, name="block", groups=[], num_trainable=trainable, has_frozen=frozen,
                use=use)


def test_forward_pairs_nest_and_release_only_when_the_last_closes():
    u = _unit()
    u.enter_forward()
    u.enter_forward()  # a module called inside itself
    assert u.use is UnitUse.FORWARD and u.users == 2 and not u.releasable
    u.leave_forward()
    assert u.use is UnitUse.FORWARD and not u.releasable
    u.leave_forward()
    assert u.use is UnitUse.IDLE and u.releasable
    u.leave_forward()  # a post-hook after the step was reset: nothing to close
    assert u.use is UnitUse.IDLE and u.users == 0


def test_held_through_recomputation_until_gradients_and_inputs():
    u = _unit(frozen=True)
    assert u.hold_for_backward() and u.use is UnitUse.HELD
    assert not u.hold_for_backward()  # held already: gathered once
    u.enter_forward()  # non-reentrant checkpointing recomputes inside the backward
    assert u.use is UnitUse.HELD_FORWARD
    assert u.grad_arrived(10) == (False, False)
    assert u.grad_arrived(11) == (True, False)
    assert not u.drop_hold()  # frozen parameters: their module's inputs' gradient is not in
    u.leave_forward()
    assert u.use is UnitUse.HELD and not u.releasable
    u.inputs_done = True
    assert u.drop_hold() and u.use is UnitUse.IDLE and u.releasable
    assert u.grad_arrived(11) == (True, True)  # a late gradient: complete already
    u.end_step()
    assert (u.use, u.users, u.grads_arrived, u.inputs_done) == (UnitUse.IDLE, 0, set(), False)


def test_pinned_units_track_nothing_and_are_never_releasable():
    u = _unit(use=UnitUse.PINNED)
    u.enter_forward()
    assert not u.hold_for_backward()
    u.end_step()
    assert u.use is UnitUse.PINNED and u.always_gathered and not u.releasable and u.users == 0
    held = _unit()
    held.hold_for_backward()
    held.pin()  # the outside-use detector pins a unit in use
    assert held.use is UnitUse.PINNED and not held.drop_hold()


def test_edges_outside_the_table_raise_naming_the_unit():
    u = _unit(use=UnitUse.PINNED)
    with pytest.raises(IllegalTransitionError, match="block"):
        u._use(UnitUse.HELD)
    assert all(new is not UnitUse.IDLE for (old, new) in USE_TRANSITIONS.edges
               if old is UnitUse.PINNED)  # nothing unpins
