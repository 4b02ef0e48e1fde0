"""Module 19's planted bugs (training through failures): see course/mutants/__init__.py."""
from course.mutants import Plant

DETECT, DATA, SAVE, RESILIENT, GOODPUT = ("m19_detect.py", "m19_data.py", "m19_async_checkpoint.py",
                                          "m19_resilient.py", "m19_goodput.py")
PLANTS = [
    # The list.
    Plant(RESILIENT, "    return {**{f\"data.{name}\": value for name, value in sampler.state().items()},\n"
                     "            \"losses\"", "    return {\"losses\"",
          "the data position not saved: the resumed run reads from the first batch again"),
    Plant(SAVE, "        if self.in_flight is not None:\n            self.in_flight.staged.result()",
          "        return",
          "the optimizer's update not held back for the copy: the checkpoint of step k holds step k + 1's weights"),
    Plant(SAVE, "        if self.in_flight is not None:\n            self.in_flight.staged.result()",
          "        if self.in_flight is not None:\n            self.in_flight.written.result()",
          "the update held back for the whole write, not only the copy: correct, but as slow as a synchronous save "
          "(a learner run's)", new=True),
    Plant(SAVE, "        self.wait()\n        final = step_directory(self.root, step)",
          "        final = step_directory(self.root, step)",
          "the previous save not awaited: two saves written at once, on one group, into one stager's buffers"),
    Plant(GOODPUT, "    return math.sqrt(2 * save_cost * mtbf)\n", "    return math.sqrt(save_cost * mtbf)\n",
          "Young's interval without its factor 2 (a failure costing a whole interval, not half of one)"),
    Plant(GOODPUT, "\n    return math.sqrt(2 * save_cost * mtbf) * (1 + math.sqrt(xi) / 3 + xi / 9) - save_cost",
          "\n    return math.sqrt(2 * save_cost * mtbf) * (1 + math.sqrt(xi) / 3 + xi / 9)",
          "Daly's correction without its -save_cost: the interval of training counted with the save in it"),
    Plant(DETECT, "    typical = per_rank.quantile(0.5)\n", "    typical = per_rank.mean()\n",
          "the job's typical rank by the mean: two slow ranks of eight pull it up until neither looks slow"),
    # Detection.
    Plant(DETECT, "    per_rank = times.double().quantile(0.5, dim=1)", "    per_rank = times.double().mean(dim=1)",
          "a rank's usual pace by the mean of its steps: one long pause makes it a straggler"),
    Plant(DETECT, "\n    return [r for r in range(len(per_rank)) if per_rank[r] > factor * typical]",
          "\n    return [r for r in range(len(per_rank)) if per_rank[r] > factor * per_rank.min()]",
          "compared with the fastest rank instead of the typical one: noise among healthy ranks flags them"),
    Plant(DETECT, "    typical = torch.tensor(step_times, dtype=torch.float64).quantile(0.5).item()",
          "    typical = max(step_times)",
          "the timeout from the longest step measured: as long as the warm-up, a hang waits that long"),
    Plant(DETECT, "    typical = torch.tensor(step_times, dtype=torch.float64).quantile(0.5).item()",
          "    typical = sum(step_times) / len(step_times)",
          "the timeout from the mean step: dragged by the warm-up and the save steps"),
    Plant(DETECT, "    return max(MIN_TIMEOUT_S, slack * typical)", "    return slack * typical",
          "no floor: steps of milliseconds make a timeout that an operating system's hiccup trips"),
    # The data position.
    Plant(DATA, "        for _ in range(epoch + 1):\n            self.order = self.draw_order()",
          "        for _ in range(epoch):\n            self.order = self.draw_order()",
          "one draw too few: past the first epoch the restored reader finishes the previous epoch's order"),
    Plant(DATA, "        self.generator.manual_seed(self.seed)\n", "",
          "the generator not started again: a fresh reader has drawn epoch 0 already, and draws further"),
    Plant(DATA, "\n        self.epoch, self.position = epoch, position", "\n        self.epoch, self.position = epoch, 0",
          "the epoch restored but not the position in it: the epoch's batches so far read again"),
    # The checkpoint.
    Plant(SAVE, "        if dist.get_rank() == 0:\n            written.add_done_callback(lambda _: self.commit(save))",
          "        if dist.get_rank() == 0:\n            partial.rename(final)\n            save.committed.set()",
          "renamed as soon as async_save returns: a checkpoint still being written takes its final name"),
    Plant(SAVE, "        save = self.in_flight = InFlight(step, staged, written, partial, final)\n",
          "        save = self.in_flight = InFlight(step, staged, written, partial, final)\n        written.result()\n",
          "the save's own write awaited before returning: correct, but synchronous again"),
    Plant(SAVE, "\n        response = dcp.async_save(state, storage_writer=self.make_writer(partial), process_group=self.group,",
          "\n        response = dcp.async_save(state, storage_writer=self.make_writer(partial), process_group=None,",
          "the write's collectives on the default group, from a thread, interleaved with the training's"),
    # The run's state and the resume.
    Plant(RESILIENT, "\n            \"losses\": torch.tensor(losses, dtype=torch.float64)}",
          "\n            \"losses\": torch.tensor(losses)}",
          "the losses kept in float32: the curve before the resume comes back rounded"),
    # Goodput.
    Plant(GOODPUT, "\n    expected = mtbf * math.exp(restart_cost / mtbf) * math.expm1(segment / mtbf)",
          "\n    expected = (mtbf + restart_cost) * math.expm1(segment / mtbf)",
          "a restart that cannot fail: too optimistic when restarts are long next to the mtbf"),
    Plant(GOODPUT, "    segment = interval + save_cost\n", "    segment = interval\n",
          "failures that never strike during a save (and saves that cost nothing)"),
    Plant(GOODPUT, "\n    xi = save_cost / (2 * mtbf)\n", "\n    xi = (save_cost + restart_cost) / (2 * mtbf)\n",
          "the restart counted in Daly's correction: a constant factor of the expected time cannot move the optimum"),
]
