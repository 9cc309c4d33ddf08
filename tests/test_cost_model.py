"""Dynamic k's choice (jspec.engine.cost) from measured step times and per-request counters."""

import pytest

from jspec.engine.cost import AcceptancePrior, CostModel

# Step times like the 2-core CPU's at 16 rows (the engine at batch 16, measured 2026-12-03).
STEP_SECONDS = {0: 0.132, 1: 0.210, 2: 0.267, 4: 0.293}


def measured() -> CostModel:
    cost = CostModel((0, 1, 2, 4))
    for k, t in STEP_SECONDS.items():
        cost.observe(k, steps=10, seconds=10 * t)
    return cost


def short_proposals(n: int = 16):
    """n-gram-like requests after 200 steps at k = 4: a proposal on 150 steps, but mostly one or
    two drafts long, so accepted / proposed is high (0.71) while the yield per step is small."""
    drafted, per_pos = 150, [90, 40, 20, 10]  # draft j accepted on that many drafted steps
    accepted = sum(per_pos)  # 160
    proposed = 225  # 150 first drafts, 50 second, 15 third, 10 fourth: 160 / 225 = 0.71
    return [(4, accepted, proposed, drafted, 200, per_pos) for _ in range(n)]


def test_short_proposals_turn_speculation_off_where_the_geometric_model_kept_k4():
    rows = short_proposals()
    per_pos = measured()
    assert per_pos.choose(rows) == 0
    tokens = per_pos.expected_tokens(4, *rows[0][1:])
    assert 1.0 < tokens < 1.0 + 160 / 200 + 0.1  # close to what the steps really yielded
    geometric = measured()  # the old estimate, without per-position counts
    assert geometric.choose([r[:5] for r in rows]) == 4


def test_long_accepted_proposals_keep_k4():
    rows = [(4, 560, 600, 150, 150, [148, 144, 138, 130]) for _ in range(16)]
    assert measured().choose(rows) == 4


def test_a_request_capped_at_k1_counts_one_draft():
    cost = measured()
    row = (1, 560, 600, 150, 150, [148, 144, 138, 130])
    assert cost.expected_tokens(1, *row[1:]) == pytest.approx(1 + (148 + 8 * 0.5) / (150 + 8) * (158 / 158))


def test_unmeasured_candidates_are_tried_first():
    cost = CostModel((0, 2, 4))
    cost.observe(0, 4, 0.4)
    assert cost.choose(short_proposals(1)) == 2


def test_stale_candidates_are_retimed_only_while_they_could_win():
    """After ``refresh_every`` choices without it a k is timed again, but not a k far slower
    than the best (each such burst cost dynamic k 10-20% at 16 slots)."""
    rows = short_proposals()  # k = 0 wins on STEP_SECONDS (tested above)
    cost = measured()
    picks = []
    for _ in range(3 * cost.refresh_every):
        picks.append(cost.choose(rows))
        cost.observe(picks[-1], steps=10, seconds=10 * STEP_SECONDS[picks[-1]])
    # k = 1's estimated rate is 0.91x k = 0's (re-timed now and then), k = 2's and 4's ~0.82x
    assert set(picks) == {0, 1} and picks.count(1) <= 3
    # drafts never accepted and steps that cost alike: every k within a few percent of the best,
    # so each is re-timed in turn while the best runs the rest
    seconds = {0: 0.100, 1: 0.101, 2: 0.102, 4: 0.103}
    rejected = [(4, 0, 225, 150, 200, [0, 0, 0, 0])] * 16
    close = CostModel(seconds)
    for k, t in seconds.items():
        close.observe(k, steps=10, seconds=10 * t)
    picks = []
    for _ in range(2 * close.refresh_every + 2):
        picks.append(close.choose(rejected))
        close.observe(picks[-1], steps=10, seconds=10 * seconds[picks[-1]])
    assert set(picks) == set(seconds) and max(map(picks.count, seconds)) > 0.9 * len(picks)


def test_step_times_are_smoothed_per_step_not_per_burst():
    """Eight one-step bursts move a k's step time as far as one eight-step burst at the same
    rate; a one-step burst alone barely moves it (its time carries the burst's fixed host cost)."""
    bursts, steps = CostModel((0, 4)), CostModel((0, 4))
    for cost in (bursts, steps):
        cost.observe(4, steps=8, seconds=8 * 0.025)
    steps.observe(4, steps=8, seconds=8 * 0.040)
    for _ in range(8):
        bursts.observe(4, steps=1, seconds=0.040)
    assert bursts.step_seconds[4] == pytest.approx(steps.step_seconds[4])
    assert steps.step_seconds[4] == pytest.approx(0.025 + 0.3 * 0.015)
    once = CostModel((0, 4))
    once.observe(4, steps=8, seconds=8 * 0.025)
    once.observe(4, steps=1, seconds=0.040)
    assert once.step_seconds[4] < 0.0257


def test_positions_never_run_are_not_counted_as_rejected():
    """A request that ran at k = 2 (draft 1 accepted on 60% of its drafted steps, draft 2 on
    40%) says nothing about drafts 3 and 4: counted against all drafted steps they read as
    always rejected and k = 2 won on batch-1 step times (where fixed k = 4 ran 1.08x faster);
    over the steps that could have proposed them, the last ratio carries on and k = 4 wins."""
    times = {0: 0.0239, 1: 0.0234, 2: 0.0231, 4: 0.0269}  # bench_engine, batch 1, 2026-12-03
    cost = CostModel((0, 1, 2, 4))
    for k, t in times.items():
        cost.observe(k, steps=10, seconds=10 * t)
    drafted, per_pos = 150, [90, 60, 0, 0]
    row = (4, 150, 250, drafted, 200, per_pos)
    assert cost.choose([row]) == 2  # without the denominators
    eligible = [150, 150, 0, 0]
    assert cost.choose([row + (eligible,)]) == 4
    e4 = cost.expected_tokens(4, *row[1:], eligible)
    p1 = (90 + 8 * 0.5) / 158
    p2 = (60 + 8 * p1 * p1) / 158
    ratio = p2 / p1
    assert e4 == pytest.approx(1 + (158 / 208) * (p1 + p2 + p2 * ratio + p2 * ratio ** 2))
    # where position 3 did run and was always rejected, k = 4 loses again
    assert cost.choose([(4, 150, 400, drafted, 200, per_pos, [150, 150, 150, 150])]) == 2


def batch_one(prior=None) -> CostModel:
    times = {0: 0.0229, 1: 0.0234, 2: 0.0243, 4: 0.0280}  # batch 1: k = 4 a little dearer than k = 2
    cost = CostModel((0, 1, 2, 4), prior=prior)
    for k, t in times.items():
        cost.observe(k, steps=10, seconds=10 * t)
    return cost


FRESH = (4, 0, 0, 0, 0, [0, 0, 0, 0], [0, 0, 0, 0])  # a request that has not run a step yet


def test_a_new_request_starts_from_what_earlier_requests_accepted():
    """At batch 1 a request's first burst is chosen before it has accepted anything: on the fixed
    prior a0^j, n-gram on code (drafts that match go on matching) got k = 2; the pooled ratios of
    the requests before it say k = 4. Requests that never accepted a draft turn it off."""
    assert batch_one().choose([FRESH]) == 2
    code = AcceptancePrior()
    for _ in range(3):  # accepted on 60%, 46%, 44%, 42% of the drafted steps (fixed k = 4)
        code.learn([60, 46, 44, 42], [100] * 4, drafted_steps=100, steps=110)
    cost = batch_one(code)
    assert cost.choose([FRESH]) == 4
    ratios = code.ratios(4, 0.5, 8.0)
    d = 1 + 0.9 + 0.81  # each request learned scales the pool by decay = 0.9 first
    assert ratios[0] == pytest.approx((60 * d + 8 * 0.5) / (100 * d + 8))  # pooled, pulled towards a0
    assert ratios[1] < ratios[2] < 1.0
    # a fresh request: the pooled share of steps with a proposal (100 / 110), the pooled P_j
    assert cost.expected_tokens(4, *FRESH[1:]) == pytest.approx(1 + (100 / 110) * sum(np_cumprod(ratios)))
    prose = AcceptancePrior()
    for _ in range(3):
        prose.learn([0, 0, 0, 0], [100] * 4, drafted_steps=100, steps=110)
    # after three requests the evidence does not yet rule out k = 1, which costs 2% more than a
    # plain step here: it is still explored; k = 2 and 4 are not, and ten such requests turn it off
    assert batch_one(prose).choose([FRESH]) == 1
    assert batch_one(prose).expected_tokens(1, *FRESH[1:]) < 0.0234 / 0.0229  # the point estimate says k = 0
    for _ in range(7):
        prose.learn([0, 0, 0, 0], [100] * 4, drafted_steps=100, steps=110)
    assert batch_one(prose).choose([FRESH]) == 0


def np_cumprod(xs):
    out, p = [], 1.0
    for x in xs:
        p *= x
        out.append(p)
    return out


def test_the_prior_forgets_and_leaves_unseen_positions_to_the_request():
    prior = AcceptancePrior(decay=0.5)
    prior.learn([10, 0], [10, 10], drafted_steps=10, steps=10)
    prior.learn([0, 0], [10, 10], drafted_steps=5, steps=10)
    assert prior.accepted == [5.0, 0.0] and prior.eligible == [15.0, 15.0]
    assert prior.proposal_share() == pytest.approx(10 / 15)
    assert prior.ratios(4, 0.5, 8.0)[2:] == [None, None]  # never eligible: the request's own ratio goes on
    # a request run at k = 0 throughout adds nothing but ages the pool: same ratios, less evidence
    prior.learn([0, 0], [0, 0], drafted_steps=0, steps=0)
    assert prior.accepted == [2.5, 0.0] and prior.eligible == [7.5, 7.5]
    assert prior.proposal_share() == pytest.approx(10 / 15)
    # a request with its own counts at the positions it ran: the pool fills only the rest
    row = (4, 150, 250, 150, 200, [90, 60, 0, 0], [150, 150, 0, 0])
    alone, pooled = batch_one(), batch_one(prior)
    assert pooled.expected_tokens(4, *row[1:]) == pytest.approx(alone.expected_tokens(4, *row[1:]), rel=0.05)


# Step times on the 2-core CPU with the GGUF's blocks, batch 1, as the engine had them when it
# settled on k = 0 (a diagnostic run, 2026-12-05): a k = 1 step 1.18x a plain one.
CPU_SECONDS = {0: 0.0055, 1: 0.0065, 2: 0.0072, 4: 0.0099}


def calibrated(**kw) -> CostModel:
    cost = CostModel(tuple(CPU_SECONDS), **kw)
    for k, t in CPU_SECONDS.items():
        cost.observe(k, steps=10, seconds=10 * t)
    return cost


def test_thin_evidence_does_not_turn_speculation_off():
    """The diagnosed run: on the first prompt one-draft proposals were accepted 10 times in 54, and
    on that point estimate k = 0 wins; at k = 0 nothing is proposed, so nothing would ever change
    it. 54 steps do not rule out the set's rate (~0.65): speculation goes on. The same rate over
    ten times the steps turns it off."""
    row = (4, 11, 62, 54, 93, [10, 1, 0, 0], [54, 8, 0, 0])
    assert calibrated(optimism=0.0).choose([row]) == 0
    assert calibrated().choose([row]) > 0
    many = (4, 110, 620, 540, 930, [100, 10, 0, 0], [540, 80, 0, 0])
    assert calibrated().choose([many]) == 0
    assert calibrated().expected_tokens(2, *many[1:], optimism=2.0) > calibrated().expected_tokens(2, *many[1:])


def simulate(cost: CostModel, rates: list[float], seed: int = 0, tokens: int = 128, burst: int = 16):
    """Requests one after another at batch 1, as ``LLMEngine`` feeds the cost model: bursts of up
    to ``burst`` steps at the chosen k, each step proposing on 90% of steps, draft 1 accepted with
    the request's rate and each later draft with probability 0.9 after an accepted one; returns,
    per request, the share of its bursts that ran at k > 0."""
    import random

    rng = random.Random(seed)
    shares = []
    for p1 in rates:
        acc, elig, drafted, steps, spec_steps, out, bursts = [0] * 4, [0] * 4, 0, 0, 0, 0, []
        while out < tokens:
            k = cost.choose([(4, sum(acc), sum(elig), drafted, steps, acc, elig)])
            bursts.append(k)
            for _ in range(burst):
                steps += 1
                out += 1
                if k == 0:
                    continue
                spec_steps += 1
                if rng.random() < 0.9:
                    drafted += 1
                    for j in range(k):
                        elig[j] += 1
                    for j in range(k):
                        if rng.random() >= (p1 if j == 0 else 0.9):
                            break
                        acc[j] += 1
                        out += 1
            cost.observe(k, burst, burst * CPU_SECONDS[k])
        if cost.prior is not None:
            cost.prior.learn(acc, elig, drafted, spec_steps)
        shares.append(sum(k > 0 for k in bursts) / len(bursts))
    return shares


@pytest.mark.parametrize("seed", range(3))
def test_one_unlucky_first_request_does_not_keep_a_run_at_k0(seed):
    """A first request whose drafts were rarely accepted (0.15), then nine whose first drafts are
    accepted 65% of the time: without exploration the engine stays at k = 0 until a re-timing
    burst happens to run k = 1 (64 bursts later; a HumanEval bench of 2026-12-05 never got there);
    with it, the requests after the next speculate."""
    rates = [0.15] + [0.65] * 9
    stuck = simulate(calibrated(optimism=0.0, prior=AcceptancePrior()), rates, seed)
    explored = simulate(calibrated(prior=AcceptancePrior()), rates, seed)
    assert max(stuck[1:4]) == 0.0
    assert min(explored[2:]) > 0.8
    # and where the drafts really are rarely accepted the whole time, speculation stays mostly off
    rejected = simulate(calibrated(prior=AcceptancePrior()), [0.05] * 10, seed)
    assert sum(rejected[5:]) / 5 < 0.2


def _tree_model(tree_seconds: float) -> CostModel:
    """Dynamic k over a 16-node tree 4 deep and its chains; the tree timed at ``tree_seconds``."""
    cost = CostModel((0, 1, 2, 4, 16), tree=(16, 4), tree_prior=AcceptancePrior())
    for k, t in {**STEP_SECONDS, 16: tree_seconds}.items():
        cost.observe(k, steps=10, seconds=10 * t)
    return cost


def _tree_rows(n: int = 4):
    """Requests whose chain steps accept less than their tree steps: 100 chain steps (draft 1
    accepted on 60 of them), 100 tree steps whose accepted path reached depth 1 on 90."""
    chain = [60, 30, 15, 7]
    tree = ([90, 70, 50, 30] + [0] * 12, 100)
    return [(16, 112 + 240, 600 + 1600, 200, 200, chain, [100] * 4, tree) for _ in range(n)]


def test_the_tree_is_chosen_where_its_rows_cost_little_and_not_where_they_cost_arithmetic():
    """The tree's estimate reads the tree steps' counters, a chain's the chain steps': a
    16-node tree that costs 1.1x a k = 4 chain step (a GPU's verification) wins on its
    acceptance; at 3.4x (the 2-core CPU's) a chain does."""
    rows = _tree_rows()
    gpu = _tree_model(1.1 * STEP_SECONDS[4])
    tree_tokens = gpu._expected(16, rows[0])
    chain_tokens = gpu._expected(4, rows[0])
    assert tree_tokens == pytest.approx(1 + (200 + 8 * 0.5) / 208 * sum(
        p for p in _cumulative([90, 70, 50, 30], 100)), rel=0.05)
    assert tree_tokens > 1.6 * chain_tokens / 1.25 and chain_tokens < 2.2
    assert gpu.choose(rows) == 16
    cpu = _tree_model(3.4 * STEP_SECONDS[4])
    chains = {k: sum(cpu._expected(k, r) for r in rows) / STEP_SECONDS[k] for k in (1, 2, 4)}
    assert cpu.choose(rows) == max(chains, key=chains.get)


def _cumulative(accepted, steps, w=8.0, a0=0.5):
    """The estimator's P_j: each pulled towards the previous one's ratio with weight w."""
    out, p_prev, ratio = [], 1.0, a0
    for a in accepted:
        p = min((a + w * p_prev * ratio) / (steps + w), p_prev)
        ratio, p_prev = p / p_prev, p
        out.append(p)
    return out


def test_without_tree_counters_the_tree_is_not_taken_for_its_chain():
    """A chain step's counters never stand for the tree: with no tree step yet, the tree's
    estimate is the prior's, whatever the chains accepted."""
    cost = _tree_model(STEP_SECONDS[4])
    strong_chain = (16, 560, 600, 150, 150, [148, 144, 138, 130], [150] * 4, ((), 0))
    weak_chain = (16, 10, 600, 150, 150, [5, 3, 1, 1], [150] * 4, ((), 0))
    assert cost._expected(16, strong_chain) == pytest.approx(cost._expected(16, weak_chain))
    assert cost._expected(4, strong_chain) > 3 * cost._expected(4, weak_chain) - 3
