"""What a run teaches the planner for the next runs of its model: its prefill and decode seconds
correct this machine's cached profile (planner/calibrate.py), and its answers' lengths are
kept for the plans of the same job or model (planner/answer_lengths.py). Run once, at a run's
end (generate.py); a busy run teaches nothing."""
from __future__ import annotations

import dataclasses

from klotski import planning
from klotski.errors import UserError
from planner import answer_lengths


def learn_from_run(config, ckpt, setup, prompt_lens, gen_lens, measured: dict, *, busy: bool,
                   pipeline_cost=None, popularity=None, skip: dict | None = None, segments=(), longest=None,
                   answers: Answers | None = None) -> dict:
    """The run as evidence for this machine's cached profile (planner/calibrate.py: `correct`):
    its prefill and decode seconds (`measured`) against the plan replayed over the run's own
    lengths, routing and shared segments; and its `answers`' lengths for the model's next plans
    (planner/answer_lengths.py). Nothing is learned from a `busy` run. Returns the report's
    `profile` section: how the profile was judged, and what this run did to it."""
    from planner import calibrate
    shape = planning.compute_shape(ckpt, setup.dtype, planning.kept_in(setup))
    profile = planning.profile_for("auto", shape, device=setup.device.type, link_gbps=config.emulate_link_gbps,
                          pipeline_cost=pipeline_cost, reuse=True, threads=config.threads)
    if busy:
        return {**calibrate.section(profile), "corrected": False,
                "why": "the machine was busy during the run: a busy run corrects nothing",
                **({"answer_lengths": {"learned": False, "why": "a busy run teaches nothing"}} if answers else {})}
    taught = {"answer_lengths": learn_answer_lengths(ckpt, answers)} if answers else {}
    if setup.plan is None or not gen_lens:
        return {**calibrate.section(profile), "corrected": False, "why": "the run had no plan to compare with",
                **taught}

    def replay(prof) -> dict | None:
        try:
            p = planning.replayed_plan(config, ckpt, setup, prompt_lens, gen_lens, pipeline_cost, popularity, profile=prof,
                              segments=segments, longest=longest)
        except (UserError, ValueError):  # the plan's budgets refused for these lengths: nothing to compare
            return None
        return {"prefill": p.job_prefill_s or 0.0, "decode": p.job_decode_s or 0.0}
    return {**calibrate.correct(profile, replay, measured, skip), **taught}


@dataclasses.dataclass
class Answers:
    """A run's answers, for the lengths the next plans take: the planned window's key
    (`answer_key`) and each planned sequence's answer length in the planned order (None where it
    gave none); every answer's length and its max_tokens."""
    key: str | None
    planned: list
    lengths: list
    caps: list


def learn_answer_lengths(ckpt, answers: Answers) -> dict:
    """Add a quiet run's answers to what `ckpt`'s next plans take; the report's words of it."""
    if not answers.lengths:
        return {"learned": False, "why": "the run generated no answers"}
    try:
        return {"learned": True, **answer_lengths.record(planning.answer_lengths_path(ckpt), answers.key, answers.planned,
                                                         list(answers.lengths), list(answers.caps), warn=planning.announce)}
    except OSError as e:
        return {"learned": False, "why": f"{planning.answer_lengths_path(ckpt)}: could not be written ({e.strerror or e})"}
