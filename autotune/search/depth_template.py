"""The trace of a model of any depth from walks of the same model cut to a few blocks (docs/depth.md).

A fake trial's trace (every allocation and release, with the marks the meter and the breakdown make among them) is
a sequence of *tokens*; a model of n identical blocks gives a sequence in which each block's stretch of events
repeats wherever the trial runs the blocks: once a forward, once a backward (and its recomputation), once per
foreach op of the optimizer's step. Three walks of the model cut to a, a + s and a + 2s blocks (s the period in
blocks: 1, or K for a policy that checkpoints every K-th block) show it:

- **Tokens.** The walk of a + s blocks is the walk of a blocks with one stretch inserted at each place where the
  blocks repeat (the longest matching blocks of the two sequences, :class:`difflib.SequenceMatcher`); each stretch
  is a *run*'s chunk, and where the walk of a blocks already holds copies of the chunk beside the insertion
  (the cut's own middle and edge blocks), those are the run's copies too. The walk of a + 2s blocks must then be
  the walk of a blocks with every chunk inserted twice, token for token: sizes, order, streams, marks. Held out,
  it is the check that the runs repeat.
- **References.** A release names the allocation it frees. Each event of the template is a *slot* (one event of
  the fixed part, or the k-th event of a run's chunk, whichever copy g); every release of a slot frees, at every
  depth, either one fixed event, or the k'-th event of copy h of one run, h = alpha g + beta (copies - 1) + delta
  with alpha in {-1, 0, 1} and beta in {0, 1} (the same block, the next one, the mirrored one of a backward, the
  first or the last), a copy past either end being one fixed event for each distance past it (the embedding's
  output, freed by the first block's backward). The rule is fitted to the three walks' releases; a slot no rule
  fits, or two rules that disagree deeper, is no proof, and the caller walks the whole model.
- **Block indices.** A mark that names a module (the breakdown's place of the peak) names the block it runs in;
  the index follows the same affine rule, fitted the same way.

A template learnt at one micro-batch serves another when the walk of a + s blocks at that size has the same
sequence but for the sizes (:meth:`Template.at_sizes_of`), each run's copies equal in it; else the template is
learnt again there. Torch-free, pure arithmetic on tuples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

__all__ = ["NoRepetition", "Template", "Walk", "learn_template"]

# A token is a hashable tuple whose first item says its kind: "A" an allocation (its size second), "F" a release
# (the size it frees second), anything else a mark (no size). Two tokens equal are the same event at two depths.
Token = tuple[Any, ...]
ALLOC = "A"
RELEASE = "F"
_SIZED = (ALLOC, RELEASE)


class NoRepetition(Exception):
    """The walks do not show the blocks repeating in a way this module can extend: the reason, in one line."""


@dataclass
class Walk:
    """One walk's sequence: ``tokens``; ``refs[i]`` the index of the allocation token a release frees (-1 for none:
    an allocation, a mark, a release of a storage the recording never saw); ``blocks[i]`` the block index a mark
    names (None where it names none)."""

    tokens: list[Token]
    refs: list[int]
    blocks: list[int | None]

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.refs) == len(self.blocks):
            raise ValueError("a walk's tokens, refs and blocks must be as long as each other")


def _shape(token: Token) -> Token:
    """The token without its size (what a walk at another micro-batch must keep)."""
    return token[:1] + token[2:] if token[0] in _SIZED else token


# Rules of a slot's reference or block index, in the extra periods c (every run has lead + c copies):
# ("fixed", j) the fixed token j; ("run", alpha, beta, delta, r, k, past) the k-th token of run r's copy
# h = alpha g + beta c + delta, ``past`` the fixed token for each distance past its copies (negative: before the
# first; else h - copies), as pairs; ("block", alpha, beta, delta) the block index alpha g + beta c + delta.
Rule = tuple[Any, ...]
# (alpha, beta): the same copy order, mirrored (a backward's), one copy from the first, one from the last.
_COPY_RULES = ((1, 0), (-1, 1), (0, 0), (0, 1))
Coord = tuple[Any, ...]  # ("f", j) a fixed token; ("x", r, g, k) the k-th token of run r's copy g


@dataclass
class _Run:
    chunk: list[Token]
    lead: int  # copies in the shallowest walk


@dataclass
class Template:
    """A trace at any depth ``base_depth + step c``: the shallowest walk's fixed tokens, its runs (each repeated
    ``lead + c`` times), and every slot's rules."""

    base_depth: int
    step: int
    fixed: list[Token]  # the shallowest walk's tokens outside the runs, in order
    # ("f", first, end): the fixed tokens first .. end - 1; ("r", index): a run.
    layout: list[tuple[Any, ...]]
    runs: list[_Run]
    ref_rules: dict[Coord, Rule] = field(default_factory=dict)
    block_rules: dict[Coord, Rule] = field(default_factory=dict)

    def periods(self, depth: int) -> int:
        """The extra periods c of a model of ``depth`` blocks (ValueError: none makes it)."""
        extra, rest = divmod(depth - self.base_depth, self.step)
        if extra < 0 or rest:
            raise ValueError(f"a template of {self.base_depth} + {self.step} c blocks cannot make {depth}")
        return extra

    def coords(self, c: int) -> list[Coord]:
        """Each token's coordinate in the walk with c extra periods."""
        coords: list[Coord] = []
        for item in self.layout:
            if item[0] == "f":
                coords.extend(("f", j) for j in range(item[1], item[2]))
            else:
                width = len(self.runs[item[1]].chunk)
                for g in range(self.runs[item[1]].lead + c):
                    coords.extend(("x", item[1], g, k) for k in range(width))
        return coords

    def tokens(self, c: int) -> list[Token]:
        tokens: list[Token] = []
        for item in self.layout:
            if item[0] == "f":
                tokens.extend(self.fixed[item[1] : item[2]])
            else:
                run = self.runs[item[1]]
                tokens.extend(run.chunk * (run.lead + c))
        return tokens

    def positions(self, c: int) -> tuple[dict[int, int], dict[int, int]]:
        """Where each fixed token and each run's first copy falls in the walk with c extra periods."""
        fixed_at: dict[int, int] = {}
        run_at: dict[int, int] = {}
        position = 0
        for item in self.layout:
            if item[0] == "f":
                for j in range(item[1], item[2]):
                    fixed_at[j] = position
                    position += 1
            else:
                run = self.runs[item[1]]
                run_at[item[1]] = position
                position += len(run.chunk) * (run.lead + c)
        return fixed_at, run_at

    def expand(self, depth: int) -> Walk:
        """The walk of a model of ``depth`` blocks.

        Raises:
            NoRepetition: a release reaches past a run further than any walk showed.
        """
        c = self.periods(depth)
        fixed_at, run_at = self.positions(c)
        refs: list[int] = []
        blocks: list[int | None] = []
        ref_rules, block_rules = self.ref_rules, self.block_rules
        for item in self.layout:
            if item[0] == "f":
                for j in range(item[1], item[2]):
                    rule = ref_rules.get(("f", j))
                    refs.append(-1 if rule is None else self._target(rule, 0, c, fixed_at, run_at))
                    block = block_rules.get(("f", j))
                    blocks.append(None if block is None else _affine(block, 0, c))
                continue
            r = item[1]
            chunk_rules = [ref_rules.get(("x", r, k)) for k in range(len(self.runs[r].chunk))]
            chunk_blocks = [block_rules.get(("x", r, k)) for k in range(len(self.runs[r].chunk))]
            for g in range(self.runs[r].lead + c):
                for rule, block in zip(chunk_rules, chunk_blocks, strict=True):
                    refs.append(-1 if rule is None else self._target(rule, g, c, fixed_at, run_at))
                    blocks.append(None if block is None else _affine(block, g, c))
        return Walk(self.tokens(c), refs, blocks)

    def _target(self, rule: Rule, g: int, c: int, fixed_at: dict[int, int], run_at: dict[int, int]) -> int:
        if rule[0] == "fixed":
            return fixed_at[rule[1]]
        h = _affine(rule, g, c)
        run = self.runs[rule[4]]
        count = run.lead + c
        if 0 <= h < count:
            return run_at[rule[4]] + h * len(run.chunk) + rule[5]
        past = h if h < 0 else h - count
        for distance, fixed in rule[6]:
            if distance == past:
                return fixed_at[fixed]
        raise NoRepetition(f"a release reaches {past} copies past a run, further than any walk showed")

    def at_sizes_of(self, walk: Walk) -> Template | None:
        """This template with the sizes of ``walk``, the walk of ``base_depth + step`` blocks at another micro-batch;
        None where that walk is not this template's at c = 1 but for its sizes and its fixed part (:meth:`_aligned`:
        another order or count in a run, other references or blocks), or where a run's copies in it differ (the
        blocks do not repeat at that size)."""
        shaped = self.expand(self.base_depth + self.step)
        same = len(shaped.tokens) == len(walk.tokens) and shaped.refs == walk.refs and shaped.blocks == walk.blocks
        if not same or any(a != b and _shape(a) != _shape(b) for a, b in zip(shaped.tokens, walk.tokens, strict=True)):
            return self._aligned(shaped, walk)
        fixed = list(self.fixed)
        runs: list[_Run] = []
        position = 0
        for item in self.layout:
            if item[0] == "f":
                fixed[item[1] : item[2]] = walk.tokens[position : position + item[2] - item[1]]
                position += item[2] - item[1]
                continue
            run = self.runs[item[1]]
            width, count = len(run.chunk), run.lead + 1
            chunk = walk.tokens[position : position + width]
            if any(walk.tokens[position + g * width : position + (g + 1) * width] != chunk for g in range(1, count)):
                return None
            runs.append(_Run(chunk, run.lead))
            position += width * count
        return Template(self.base_depth, self.step, fixed, self.layout, runs, self.ref_rules, self.block_rules)

    def _aligned(self, shaped: Walk, walk: Walk) -> Template | None:
        """The template whose fixed part is the walk's where the two differ only there (a size whose embedding or
        loss runs other ops: m = 1 against m = 2), its runs and rules carried over; None where they differ in a run,
        a rule names a fixed event the walk lacks, a new release frees a run's event, or the result does not give the
        walk back exactly."""
        coords = self.coords(1)
        mine, theirs = [_shape(t) for t in shaped.tokens], [_shape(t) for t in walk.tokens]
        moved: dict[int, int] = {}  # the template's position -> the walk's, where they match
        i = j = 0
        try:
            gaps = _differences(mine, theirs, inserts_only=False)
        except NoRepetition:
            return None
        for i1, i2, j1, j2 in [*gaps, (len(mine), len(mine), len(theirs), len(theirs))]:
            moved.update(zip(range(i, i1), range(j, j1), strict=True))
            if any(coord[0] != "f" for coord in coords[i1:i2]):
                return None
            i, j = i2, j2
        fixed: list[Token] = []
        layout: list[tuple[Any, ...]] = []
        runs: list[_Run] = []
        new_fixed: dict[int, int] = {}  # the walk's position -> its index among the new fixed tokens
        _, run_at = self.positions(1)
        done = 0  # the walk's tokens placed
        for r, run in enumerate(self.runs):
            width, count = len(run.chunk), run.lead + 1
            span = [moved.get(run_at[r] + i) for i in range(width * count)]
            start = span[0]
            if start is None or span != list(range(start, start + width * count)) or start < done:
                return None
            if start > done:
                layout.append(("f", len(fixed), len(fixed) + start - done))
                new_fixed.update((done + i, len(fixed) + i) for i in range(start - done))
                fixed.extend(walk.tokens[done:start])
            layout.append(("r", r))
            runs.append(_Run(walk.tokens[start : start + width], run.lead))
            done = start + width * count
        if done < len(walk.tokens):
            layout.append(("f", len(fixed), len(fixed) + len(walk.tokens) - done))
            new_fixed.update((done + i, len(fixed) + i) for i in range(len(walk.tokens) - done))
            fixed.extend(walk.tokens[done:])
        fixed_at, _ = self.positions(1)
        renamed = {j: new_fixed.get(moved.get(at, -1)) for j, at in fixed_at.items()}  # old fixed -> new
        made = Template(self.base_depth, self.step, fixed, layout, runs)
        try:
            made.ref_rules = _carried(self.ref_rules, renamed)
            made.block_rules = _carried(self.block_rules, renamed)
        except KeyError:
            return None
        new_coords = made.coords(1)
        for position, index in new_fixed.items():
            slot = ("f", index)
            ref = walk.refs[position]
            if slot not in made.ref_rules and ref >= 0:
                if new_coords[ref][0] != "f":
                    return None
                made.ref_rules[slot] = ("fixed", new_coords[ref][1])
            if slot not in made.block_rules and walk.blocks[position] is not None:
                return None
        remade = made.expand(self.base_depth + self.step)
        if remade.tokens != walk.tokens or remade.refs != walk.refs or remade.blocks != walk.blocks:
            return None
        return made


def _carried(rules: dict[Coord, Rule], renamed: dict[int, int | None]) -> dict[Coord, Rule]:
    """Rules with the fixed tokens they name (and their own fixed slots) renumbered; KeyError where one is gone."""

    def fixed(j: int) -> int:
        new = renamed[j]
        if new is None:
            raise KeyError(j)
        return new

    carried: dict[Coord, Rule] = {}
    for slot, rule in rules.items():
        if slot[0] == "f":
            if renamed.get(slot[1]) is None:
                continue  # a fixed event the walk lacks: its rule goes with it
            slot = ("f", fixed(slot[1]))
        if rule[0] == "fixed":
            rule = ("fixed", fixed(rule[1]))
        elif rule[0] == "run":
            rule = (*rule[:6], tuple((distance, fixed(j)) for distance, j in rule[6]))
        carried[slot] = rule
    return carried


def _affine(rule: Rule, g: int, c: int) -> int:
    return int(rule[1] * g + rule[2] * c + rule[3])


def learn_template(walks: Sequence[Walk], base_depth: int, step: int = 1, *, prior: Template | None = None) -> Template:
    """The template of three walks of the model cut to ``base_depth``, ``base_depth + step`` and
    ``base_depth + 2 step`` blocks (the module docstring). Every walk given is reproduced exactly by the template,
    the third's tokens held out from the runs' finding.

    With two walks and a ``prior``, a template learnt from three at another size or another start of the trial
    (the first trial's, whose FSDP2 initialises what the later ones reuse): the runs are the two walks' and must be
    the prior's (as many, each with as many copies); where the two walks leave a slot's rule open deeper (which a
    third walk would settle), the rule of the prior's slot it stands for settles it, else NoRepetition.

    Raises:
        NoRepetition: the walks do not repeat in a way a template can say (the reason, in one line).
    """
    if len(walks) < 3 and (prior is None or len(walks) < 2):
        raise NoRepetition("three walks are needed (two and a template learnt from three): two find the runs")
    template = _runs_of(walks[0].tokens, walks[1].tokens, base_depth, step)
    settle = _Prior.of(prior, template) if len(walks) < 3 and prior is not None else None
    for c, walk in enumerate(walks):
        if template.tokens(c) != walk.tokens:
            raise NoRepetition(
                f"the walk of {base_depth + c * step} blocks is not the walk of {base_depth} with its "
                f"repeating stretches repeated {c} times"
            )
    coords = [template.coords(c) for c in range(len(walks))]
    template.ref_rules = _fit_references(template, walks, coords, settle)
    template.block_rules = _fit_blocks(template, walks, coords, settle)
    for c, walk in enumerate(walks):
        made = template.expand(base_depth + c * step)
        if made.refs != walk.refs or made.blocks != walk.blocks:
            raise NoRepetition(f"the rules fitted do not give the walk of {base_depth + c * step} blocks")
    return template


def _runs_of(shallow: list[Token], deeper: list[Token], base_depth: int, step: int) -> Template:
    """The fixed tokens and the runs: what the deeper walk inserts in the shallow one, each insertion widened to
    the copies of its chunk beside it in the shallow walk."""
    inserts: list[tuple[int, list[Token]]] = []
    for i1, i2, j1, j2 in _differences(shallow, deeper, inserts_only=True):
        if i2 > i1:
            raise NoRepetition(f"the deeper walk changes the shallow one (at event {i1}), not only adds to it")
        inserts.append((i1, deeper[j1:j2]))
    if not inserts:
        raise NoRepetition("the deeper walk adds nothing: its blocks leave no trace")
    fixed: list[Token] = []
    layout: list[tuple[Any, ...]] = []
    runs: list[_Run] = []
    done = 0  # shallow tokens placed so far
    for index, (at, chunk) in enumerate(inserts):
        width = len(chunk)
        limit = inserts[index + 1][0] if index + 1 < len(inserts) else len(shallow)
        before = 0
        while at - (before + 1) * width >= done and shallow[at - (before + 1) * width : at - before * width] == chunk:
            before += 1
        after = 0
        while at + (after + 1) * width <= limit and shallow[at + after * width : at + (after + 1) * width] == chunk:
            after += 1
        start = at - before * width
        if start > done:
            layout.append(("f", len(fixed), len(fixed) + start - done))
            fixed.extend(shallow[done:start])
        layout.append(("r", len(runs)))
        runs.append(_Run(list(chunk), before + after))
        done = at + after * width
    if done < len(shallow):
        layout.append(("f", len(fixed), len(fixed) + len(shallow) - done))
        fixed.extend(shallow[done:])
    return Template(base_depth, step, fixed, layout, runs)


# Marks every walk of a model makes alike whatever its depth (the held storages' end, the meter's checkpoints, the
# trial's phases): the walks are diffed between them, each stretch on its own.
_BOUNDARIES = frozenset({"H", "K", "P"})


def _differences(a: list[Token], b: list[Token], *, inserts_only: bool) -> list[tuple[int, int, int, int]]:
    """Where two walks differ, as (i1, i2, j1, j2): a[i1:i2] stands where b has b[j1:j2], in order; between them the
    walks are equal. Diffed (difflib's longest matching blocks, every token an anchor) between the marks both walks
    make alike (phases, checkpoints), stretch by stretch: the cost of a diff grows as the square of what it
    compares, and a stretch is a phase of one micro-batch.

    Raises:
        NoRepetition: ``inserts_only`` and a stretch of ``a`` that ``b`` lacks.
    """
    ids: dict[Token, int] = {}
    xs = [ids.setdefault(token, len(ids)) for token in a]
    ys = [ids.setdefault(token, len(ids)) for token in b]
    cuts_a = [i for i, token in enumerate(a) if token[0] in _BOUNDARIES]
    cuts_b = [j for j, token in enumerate(b) if token[0] in _BOUNDARIES]
    if [xs[i] for i in cuts_a] != [ys[j] for j in cuts_b]:
        cuts_a = cuts_b = []
    gaps: list[tuple[int, int, int, int]] = []
    for i0, i1, j0, j1 in zip([0, *cuts_a], [*cuts_a, len(a)], [0, *cuts_b], [*cuts_b, len(b)], strict=True):
        for tag, k1, k2, l1, l2 in SequenceMatcher(None, xs[i0:i1], ys[j0:j1], autojunk=False).get_opcodes():
            if tag == "equal":
                continue
            if inserts_only and k2 > k1:
                raise NoRepetition(f"the deeper walk changes the shallow one (at event {i0 + k1}), not only adds to it")
            gaps.append((i0 + k1, i0 + k2, j0 + l1, j0 + l2))
    return gaps


def _observations(
    walks: Sequence[Walk], coords: list[list[Coord]], values: str
) -> dict[Coord, list[tuple[int, int, Any]]]:
    """Per slot, (copy g, periods c, what the walk says there): the coordinate a release frees, or a mark's block."""
    seen: dict[Coord, list[tuple[int, int, Any]]] = {}
    for c, (walk, walk_coords) in enumerate(zip(walks, coords, strict=True)):
        pairs: list[tuple[int, Any]]
        if values == "refs":
            pairs = [(i, walk_coords[ref]) for i, ref in enumerate(walk.refs) if ref >= 0]
        else:
            pairs = [(i, block) for i, block in enumerate(walk.blocks) if block is not None]
        for i, value in pairs:
            coord = walk_coords[i]
            slot = coord if coord[0] == "f" else ("x", coord[1], coord[3])
            seen.setdefault(slot, []).append((0 if coord[0] == "f" else coord[2], c, value))
    return seen


def _fit_references(
    template: Template, walks: Sequence[Walk], coords: list[list[Coord]], settle: _Prior | None
) -> dict[Coord, Rule]:
    rules: dict[Coord, Rule] = {}
    for slot, seen in _observations(walks, coords, "refs").items():
        counts = {c: sum(1 for _, cc, _ in seen if cc == c) for c in range(len(walks))}
        expected = {c: _slot_count(template, slot, c) for c in range(len(walks))}
        if counts != expected:  # a slot that frees at one depth and not at another
            raise NoRepetition(f"a release of slot {slot} is not at every depth")
        rules[slot] = _fit_reference(template, slot, seen, settle)
    return rules


def _slot_count(template: Template, slot: Coord, c: int) -> int:
    return 1 if slot[0] == "f" else template.runs[slot[1]].lead + c


def _fit_reference(template: Template, slot: Coord, seen: list[tuple[int, int, Any]], settle: _Prior | None) -> Rule:
    carried = settle.carried(slot, "release") if settle is not None else None
    if carried is not None and _fits(carried, template, seen):
        return carried  # proven from three walks where this slot stands, and true of these two
    targets = {target for _, _, target in seen}
    if len(targets) == 1 and next(iter(targets))[0] == "f":
        return ("fixed", next(iter(targets))[1])
    fits: list[Rule] = []
    run_targets = {(t[1], t[3]) for _, _, t in seen if t[0] == "x"}
    for r, k in run_targets:
        count = template.runs[r].lead
        for alpha, beta in _COPY_RULES:
            if slot[0] == "f" and alpha:
                continue
            deltas = {t[2] - alpha * g - beta * c for g, c, t in seen if t[0] == "x"}
            if len(deltas) != 1:
                continue
            delta = deltas.pop()
            past: dict[int, int] = {}
            for g, c, target in seen:
                h = alpha * g + beta * c + delta
                inside = 0 <= h < count + c
                if inside != (target[0] == "x") or (inside and (target[1], target[3]) != (r, k)):
                    break
                if not inside:
                    distance = h if h < 0 else h - count - c
                    if past.setdefault(distance, target[1]) != target[1]:
                        break
            else:
                fits.append(("run", alpha, beta, delta, r, k, tuple(sorted(past.items()))))
    if not fits:
        raise NoRepetition(f"no rule gives the allocations a release of slot {slot} frees at every depth")
    return _one(fits, slot, "release", template, settle)


def _one(fits: list[Rule], slot: Coord, what: str, template: Template, settle: _Prior | None = None) -> Rule:
    """The one rule, where several fit the walks: they must say the same deeper (probed at four more depths, which
    rules of this family, affine in g and c, agree beyond once they agree there), or the prior settles it."""
    if len(fits) > 1:
        answers = {tuple(_said(rule, template, slot, c) for c in _PROBES) for rule in fits}
        if len(answers) > 1:
            settled = [rule for rule in fits if settle is not None and settle.agrees(rule, template, slot, what)]
            if not settled:
                raise NoRepetition(f"the walks leave the {what} of slot {slot} ambiguous deeper")
            return settled[0]
    return fits[0]


# The depths past the walks at which rules are compared (rules affine in g and c that agree at four agree beyond).
_PROBES = range(3, 7)


@dataclass
class _Prior:
    """A template learnt from three walks, standing for the slots of one learnt from two: the two templates' walks
    of ``base_depth + step`` blocks lined up by shape (the sizes are another size's; the first trial's walk holds
    what FSDP2's first iteration adds), each run the prior's run most of its tokens line up with (where that run has
    as many copies), each token the prior's it lines up with."""

    template: Template
    runs: dict[int, int]  # this template's run -> the prior's
    chunk: dict[int, dict[int, int]]  # per run: this chunk's token -> the prior's chunk's
    fixed: dict[int, int]  # this fixed token -> the prior's

    @classmethod
    def of(cls, prior: Template, template: Template) -> _Prior:
        mine, theirs = template.coords(1), prior.coords(1)
        lined_up = _matched(template.tokens(1), prior.tokens(1))
        votes: dict[int, dict[int, int]] = {}
        fixed: dict[int, int] = {}
        for i, j in lined_up.items():
            a, b = mine[i], theirs[j]
            if a[0] == "f" and b[0] == "f":
                fixed[a[1]] = b[1]
            elif a[0] == "x" and b[0] == "x":
                votes.setdefault(a[1], {}).setdefault(b[1], 0)
                votes[a[1]][b[1]] += 1
        runs = {r: max(counts, key=counts.__getitem__) for r, counts in votes.items()}
        runs = {r: p for r, p in runs.items() if prior.runs[p].lead == template.runs[r].lead}
        chunk: dict[int, dict[int, int]] = {r: {} for r in runs}
        for i, j in lined_up.items():
            a, b = mine[i], theirs[j]
            if a[0] == "x" and b[0] == "x" and runs.get(a[1]) == b[1] and a[2] == b[2]:
                chunk[a[1]][a[3]] = b[3]
        return cls(prior, runs, chunk, fixed)

    def slot(self, slot: Coord) -> Coord | None:
        if slot[0] == "f":
            j = self.fixed.get(slot[1])
            return None if j is None else ("f", j)
        k = self.chunk.get(slot[1], {}).get(slot[2])
        return None if k is None else ("x", self.runs[slot[1]], k)

    def agrees(self, rule: Rule, template: Template, slot: Coord, what: str) -> bool:
        """Whether ``rule`` says deeper what the prior's rule of the slot it stands for says."""
        theirs = self.slot(slot)
        rules = self.template.ref_rules if what == "release" else self.template.block_rules
        prior_rule = rules.get(theirs) if theirs is not None else None
        if prior_rule is None or theirs is None:
            return False
        for c in _PROBES:
            said = _said(rule, template, slot, c)
            if what == "release":
                said = tuple(self._coord(coord) for coord in said)
            if said != _said(prior_rule, self.template, theirs, c):
                return False
        return True

    def carried(self, slot: Coord, what: str) -> Rule | None:
        """The prior's rule of the slot ``slot`` stands for, in this template's coordinates (None: no such slot, or a
        rule that names a token this template lacks)."""
        theirs = self.slot(slot)
        rules = self.template.ref_rules if what == "release" else self.template.block_rules
        rule = rules.get(theirs) if theirs is not None else None
        if rule is None or rule[0] == "block":
            return rule
        fixed = {j: i for i, j in self.fixed.items()}
        if rule[0] == "fixed":
            return None if rule[1] not in fixed else ("fixed", fixed[rule[1]])
        runs = {p: r for r, p in self.runs.items()}
        r = runs.get(rule[4])
        k = None if r is None else {kp: km for km, kp in self.chunk[r].items()}.get(rule[5])
        if k is None or any(j not in fixed for _, j in rule[6]):
            return None
        return ("run", rule[1], rule[2], rule[3], r, k, tuple((distance, fixed[j]) for distance, j in rule[6]))

    def _coord(self, coord: Coord) -> Coord | None:
        """A coordinate of this template as the prior's (None where it stands for none of the prior's)."""
        if coord[0] == "f":
            return coord if coord[1] is None else (None if coord[1] not in self.fixed else ("f", self.fixed[coord[1]]))
        k = self.chunk.get(coord[1], {}).get(coord[3])
        return None if k is None else ("x", self.runs[coord[1]], coord[2], k)


def _fits(rule: Rule, template: Template, seen: list[tuple[int, int, Any]]) -> bool:
    """Whether ``rule`` gives every observation of its slot: (copy g, periods c, the coordinate freed or the
    block named)."""
    for g, c, value in seen:
        if rule[0] == "block":
            if _affine(rule, g, c) != value:
                return False
        elif rule[0] == "fixed":
            if value != ("f", rule[1]):
                return False
        else:
            h, count = _affine(rule, g, c), template.runs[rule[4]].lead + c
            if 0 <= h < count:
                if value != ("x", rule[4], h, rule[5]):
                    return False
            elif value != ("f", dict(rule[6]).get(h if h < 0 else h - count)):
                return False
    return True


def _matched(mine: list[Token], theirs: list[Token]) -> dict[int, int]:
    """Each token of ``mine`` that lines up with one of ``theirs`` by shape, by index."""
    a, b = [_shape(t) for t in mine], [_shape(t) for t in theirs]
    matched: dict[int, int] = {}
    i = j = 0
    for i1, i2, j1, j2 in [*_differences(a, b, inserts_only=False), (len(a), len(a), len(b), len(b))]:
        matched.update(zip(range(i, i1), range(j, j1), strict=True))
        i, j = i2, j2
    return matched


def _said(rule: Rule, template: Template, slot: Coord, c: int) -> tuple[Any, ...]:
    """What a rule says for every copy of a slot at c extra periods (the coordinates it names)."""
    copies = range(1 if slot[0] == "f" else template.runs[slot[1]].lead + c)
    if rule[0] == "fixed":
        return tuple(("f", rule[1]) for _ in copies)
    if rule[0] == "block":
        return tuple(_affine(rule, g, c) for g in copies)
    said: list[tuple[Any, ...]] = []
    for g in copies:
        h = _affine(rule, g, c)
        count = template.runs[rule[4]].lead + c
        if 0 <= h < count:
            said.append(("x", rule[4], h, rule[5]))
        else:
            past = dict(rule[6]).get(h if h < 0 else h - count)
            said.append(("f", past))
    return tuple(said)


def _fit_blocks(
    template: Template, walks: Sequence[Walk], coords: list[list[Coord]], settle: _Prior | None
) -> dict[Coord, Rule]:
    rules: dict[Coord, Rule] = {}
    step = template.step
    for slot, seen in _observations(walks, coords, "blocks").items():
        carried = settle.carried(slot, "block") if settle is not None else None
        if carried is not None and _fits(carried, template, seen):
            rules[slot] = carried
            continue
        fits = []
        for alpha, beta in _COPY_RULES:
            if slot[0] == "f" and alpha:
                continue
            deltas = {block - alpha * step * g - beta * step * c for g, c, block in seen}
            if len(deltas) == 1:
                fits.append(("block", alpha * step, beta * step, deltas.pop()))
        if not fits:
            raise NoRepetition(f"no rule gives the block a mark of slot {slot} names at every depth")
        rules[slot] = _one(fits, slot, "block", template, settle)
    return rules
