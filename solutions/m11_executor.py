"""Module 11 - the executor: run any valid schedule on real ranks.

Module 05 had one loop per schedule. Here there is one loop for all of them: each rank walks its
list of actions (m11_actions) and runs each on the stage it names (m11_stage), receiving what the
action needs from the stage that computed it and sending its result to the stage that waits for it
(the chapter's table of actions says which).

Sends are non-blocking and all waited for at the end of the step (module 05's rules); receives
block, but StageComms posts each rank's next few receives early, so that their data can arrive
while the rank computes (gloo moves a message only once its receive is posted). Which schedule can
run this way without a rank waiting forever is the validator's question (course/validate.py), asked
before the first step: a schedule it passes cannot hang here. Training is module 05's loop (`fit`),
with run_schedule as its step.

With several stages per rank the stage after s is not always on the next rank (looped placement:
stage p-1 sends to rank 0), and may be on the same rank (the V's turn). StageComms finds the peer
from the placement and tags each message with what it is, so messages may arrive in any order.

The ranks of a schedule (its placement's values, the index of its lists) are places in the
pipeline's group (course/mesh.py's `Group`): every rank of the job, or one axis of a bigger mesh.
StageComms turns a place into the global rank a message goes to.
"""
import torch

from course.mesh import Group
from course.validate import validate
from .m00_monolith import MLPConfig
from .m04_sharded import check_stages
from .m05_schedules import fit, split_microbatches, wait_all
from .m11_actions import Action, Schedule
from .m11_stage import SplitStage

MESSAGES = ("act", "grad")  # an activation for stage s, or the gradient of stage s's output
# gloo sends a message's data only once the receiver has posted its receive: a receive posted at the
# moment of need costs a round trip and two wake-ups (about 1.5 ms with 4 ranks on 2 cores). Posting
# the next receives early hides that behind compute. Measured (bench 11, p = 4, m = 8, 16 ms per
# layer): DualPipeV's bubble 7.1 points above the simulator's with none ahead, 1.1 with three.
RECEIVES_AHEAD = 3


class _Delivered:
    """The handle of a message between two stages of one rank: nothing to wait for."""

    def wait(self):
        return None


class StageComms:
    """Point-to-point messages between stages, by stage rather than by rank (given).

    `pp` is the pipeline's group and `placement[stage]` the place in it (0 .. pp.size - 1) of the
    rank that holds the stage; a message goes to global rank pp.ranks[place].
    send(tensor, "act", stage, i) sends stage `stage`'s input for microbatch i to the rank that holds
    it; recv("act", stage, i, shape) receives it there. "grad" is the gradient of stage `stage`'s
    output, sent back by stage + 1. Each message has its own tag, so the receiver gets the one it
    asks for whatever else is in flight. Built on module 02's non-blocking send and receive, through the
    group's collectives (course/collectives.py: its isend and irecv name the peer by its place in the group and
    log each message under the group's axis, so a benchmark can count the pipeline's bytes), on gloo: nccl
    ignores tags and matches messages by their order alone.

    `order`, this rank's list of actions, tells which messages it will receive and when: each recv
    first posts the next RECEIVES_AHEAD of them (with its own shape: every message of this pipeline
    has one), so that a message whose receive is due later can travel in the meantime.
    """

    def __init__(self, pp: Group, placement, n_microbatches: int, device=torch.device("cpu"), dtype=torch.float32,
                 order=()):
        if any(not 0 <= place < pp.size for place in placement):
            raise ValueError(f"the placement {list(placement)} names places beyond the pipeline group's "
                             f"{pp.size} ranks (0 .. {pp.size - 1})")
        self.pp, self.placement, self.n_microbatches = pp, tuple(placement), n_microbatches
        self.device, self.dtype = torch.device(device), dtype
        self.local: dict[tuple, torch.Tensor] = {}  # messages between two stages of this rank
        self.expected = [key for action in order for key in self._remote_receives(action)]
        self.posted: dict[tuple, tuple] = {}  # (message, stage, microbatch) -> (buffer, handle)

    def tag(self, message: str, stage: int, microbatch: int) -> int:
        return (MESSAGES.index(message) * len(self.placement) + stage) * self.n_microbatches + microbatch

    @staticmethod
    def label(message: str, stage: int, microbatch: int) -> str:
        """What the collectives log calls the message."""
        return f"{message} stage {stage} microbatch {microbatch}"

    def send(self, tensor: torch.Tensor, message: str, stage: int, microbatch: int):
        """Start sending `message` for `stage` (its input: "act"; its output's gradient: "grad");
        return the handle to wait on before the step ends."""
        self._check(message, stage, microbatch, "send", self._sender(message, stage))
        peer = self.placement[stage]
        if peer == self.pp.index:
            self.local[(message, stage, microbatch)] = tensor
            return _Delivered()
        return self.pp.collectives.isend(tensor, peer, self.label(message, stage, microbatch),
                                         tag=self.tag(message, stage, microbatch))

    def recv(self, message: str, stage: int, microbatch: int, shape) -> torch.Tensor:
        """Wait for `message` for `stage` and microbatch; it comes from the stage before ("act") or after ("grad")."""
        self._check(message, stage, microbatch, "receive", stage)
        key = (message, stage, microbatch)
        if self.placement[self._sender(message, stage)] == self.pp.index:
            return self.local.pop(key)
        upcoming = self.expected[self.expected.index(key) + 1:][:RECEIVES_AHEAD] if key in self.expected else []
        for posting in (key, *upcoming):
            if posting not in self.posted:
                self.posted[posting] = self._post(posting, shape)
        buffer, handle = self.posted.pop(key)
        handle.wait()
        return buffer

    def _post(self, key, shape):
        """Start receiving message `key` into a new buffer; return (buffer, handle)."""
        message, stage, microbatch = key
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        peer = self.placement[self._sender(message, stage)]
        return buffer, self.pp.collectives.irecv(buffer, peer, self.label(message, stage, microbatch),
                                                 tag=self.tag(message, stage, microbatch))

    def _remote_receives(self, action: Action):
        """[the key of the message `action` receives from another rank], or [] if it receives none from one."""
        last = len(self.placement) - 1
        if action.kind == "F" and action.stage > 0:
            key = ("act", action.stage, action.microbatch)
        elif action.kind in ("B", "I") and action.stage < last:
            key = ("grad", action.stage, action.microbatch)
        else:
            return []
        return [key] if self.placement[self._sender(key[0], action.stage)] != self.pp.index else []

    @staticmethod
    def _sender(message: str, stage: int) -> int:
        """The stage that sends `message` to `stage`: the one before it ("act"), or after it ("grad")."""
        return stage - 1 if message == "act" else stage + 1

    def _check(self, message, stage, microbatch, verb, mine):
        """A message this rank cannot take part in would wait forever on the other side: refuse it now."""
        if message not in MESSAGES:
            raise ValueError(f"unknown message {message!r}: one of {MESSAGES}")
        if not (0 <= stage < len(self.placement) and 0 <= self._sender(message, stage) < len(self.placement)):
            raise ValueError(f"no stage sends {message!r} to stage {stage}: stage 0 receives no activation, the "
                             f"last stage ({len(self.placement) - 1}) no gradient")
        if self.placement[mine] != self.pp.index:
            raise ValueError(f"rank {self.pp.index} cannot {verb} {message!r} of stage {stage}, microbatch {microbatch}: "
                             f"stage {mine} does that, on rank {self.placement[mine]}. A message is named by the "
                             "stage that receives it")


def build_stages(cfg: MLPConfig, schedule: Schedule, pp: Group) -> dict[int, SplitStage]:
    """This rank's stages of the schedule's placement (those at its place in the pipeline group `pp`),
    by stage index, with the monolith's weights."""
    if schedule.world_size != pp.size:
        raise ValueError(f"{schedule.name} has lists for {schedule.world_size} ranks, the pipeline group has {pp.size}")
    check_stages(cfg, schedule.n_stages)
    return {stage: SplitStage(cfg, stage, schedule.n_stages) for stage in schedule.stages_of(pp.index)}


def run_action(action: Action, stage: SplitStage, comms: StageComms, xs, ys, sends: list):
    """Run one action on `stage` (the stage it names): receive, compute, send. Returns the loss share
    of a last stage's F, else None. `xs`, `ys`: the microbatches; `sends`: the handles of the step."""
    m, n_microbatches = action.microbatch, len(xs)
    shape = (xs[m].shape[0], stage.hidden)
    # >>> TODO(m11): one action: F, B, I or W, with its messages
    # Contract: the action's computation runs on `stage` (SplitStage: forward, backward, backward_input,
    # backward_weight) on the input it needs, and every stage that will wait for its result is sent it:
    # - what each kind needs and who waits for its result is the chapter's table of actions (docs/11, "An
    #   action, a schedule"); an input that comes from the batch or from the loss travels in no message;
    # - StageComms names a message by the stage that receives it and what it is ("act": that stage's input,
    #   "grad": the gradient of that stage's output), whichever rank holds the two stages; recv's shape is
    #   `shape` (every message of this pipeline has it);
    # - every send's handle goes into `sends` (the step waits for them all);
    # - returns the loss share the last stage's forward returns, else None.
    # The question, per kind: what does it receive, from which stage, and what does it send, to which; on
    # which stages is there nothing to receive or to send?
    # Pitfalls:
    # - a message named after the wrong stage is refused by StageComms at once (e.g. "no stage sends 'act' to
    #   stage 0: ..."), where the receiver would otherwise wait forever: which stage names a message?
    # - a handle not kept is a send gloo may drop: does the peer then wait forever in its recv?
    # - B is backward_input and backward_weight in one: does a W follow it in the schedule?
    # Hint 1: for each kind, which row of the chapter's table of actions (docs/11, "An action, a schedule") says
    #         who waits for its result, and which stages have no stage before or after them?
    # Hint 2: F: its input is the batch's microbatch on the first stage, else the "act" message of its own stage;
    #         on the last stage it returns the loss share, else its output is the "act" message of stage
    #         action.stage + 1. B and I: the gradient is nothing on the last stage (the loss), else the "grad"
    #         message of their own stage; unless on the first stage, the input's gradient is the "grad" message of
    #         stage action.stage - 1. W: receives and sends nothing.
    # Hint 3: F: inp = xs[m] if stage.is_first else comms.recv("act", action.stage, m, shape)
    #            out = stage.forward(inp, m, ys[m], n_microbatches); return out on the last stage,
    #            else sends.append(comms.send(out, "act", action.stage + 1, m))
    #         B/I: grad = None if stage.is_last else comms.recv("grad", action.stage, m, shape)
    #            dx = (stage.backward if B else stage.backward_input)(m, grad)
    #            unless stage.is_first: sends.append(comms.send(dx, "grad", action.stage - 1, m))
    #         W: stage.backward_weight(m); return None
    if action.kind == "F":
        inp = xs[m] if stage.is_first else comms.recv("act", action.stage, m, shape)
        out = stage.forward(inp, m, ys[m], n_microbatches)
        if stage.is_last:
            return out
        sends.append(comms.send(out, "act", action.stage + 1, m))
    elif action.kind in ("B", "I"):
        grad = None if stage.is_last else comms.recv("grad", action.stage, m, shape)
        backward = stage.backward if action.kind == "B" else stage.backward_input
        grad_input = backward(m, grad)
        if not stage.is_first:
            sends.append(comms.send(grad_input, "grad", action.stage - 1, m))
    elif action.kind == "W":
        stage.backward_weight(m)
    else:
        raise ValueError(f"unknown action kind {action.kind!r} in {action}")
    return None
    # <<<


def run_schedule(schedule: Schedule, stages: dict[int, SplitStage], comms: StageComms, x, y):
    """One step: this rank's list of `schedule` on its `stages`. Returns the batch loss (the sum of
    the shares) on the rank holding the last stage, else None; every send has completed."""
    xs, ys = split_microbatches(x, schedule.n_microbatches), split_microbatches(y, schedule.n_microbatches)
    # >>> TODO(m11): one step: this rank's whole list, every send completed, the loss
    # Contract: every action of this rank's list (the schedule's list at its place in the pipeline group) has
    #   run on its stage, in the list's order. Returns the step's batch loss on the rank holding the last stage
    #   (the tests compare it with the monolith's bit for bit, so the shares add up in microbatch order), None
    #   elsewhere. When it returns, no send of the step is still in flight.
    # The question: what must still be done once the last action has run?
    # Pitfalls:
    # - on gloo a send whose handle is dropped is usually lost: what happens to the peer's recv, and to a
    #   tensor the next step overwrites while it is still in flight?
    # - what does a rank without the last stage return: None, or 0 (train keeps only the real losses)?
    # Hint 1: which handles must outlive run_action, and when is it safe to stop waiting for them (module 05's
    #         rules, docs/05)?
    # Hint 2: one list of send handles for the whole step, filled by every run_action and waited for once at
    #         the end; the loss is the sum, in microbatch order, of the shares that are not None.
    # Hint 3: sends, shares = [], []
    #         for action in schedule.orders[comms.pp.index]:
    #             share = run_action(action, stages[action.stage], comms, xs, ys, sends); keep it if not None
    #         wait_all(sends); return sum(shares) if shares else None
    sends, shares = [], []
    for action in schedule.orders[comms.pp.index]:
        share = run_action(action, stages[action.stage], comms, xs, ys, sends)
        if share is not None:
            shares.append(share)
    wait_all(sends)
    return sum(shares) if shares else None
    # <<<


def train(schedule: Schedule, stages: dict[int, SplitStage], comms: StageComms, cfg: MLPConfig = MLPConfig(),
          run_step=None, on_step=None):
    """Train this rank's `stages` with `schedule` for cfg.steps steps in module 05's loop (`fit`, with
    its `on_step`); return (stages, losses), the losses on the rank holding the last stage only
    (elsewhere an empty list). The schedule is validated first: one that could deadlock is refused
    before any message is sent. `run_step` stands in for run_schedule (the demo hands it a profiled
    one, as module 05's demo does)."""
    validate(schedule)
    run_step = run_step or run_schedule
    parameters = [p for stage in stages.values() for p in stage.parameters()]
    losses = fit(lambda x, y: run_step(schedule, stages, comms, x, y), parameters, cfg, comms.device, on_step)
    return stages, losses
