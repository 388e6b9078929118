"""The goodput autoscaling policy: replicas and per-replica admission limits (pure, stdlib only).

``decide(now, obs, spec, state) -> Decision`` is called once per period with one observation of
the fleet. It does no I/O and keeps everything it remembers in ``PolicyState`` (JSON-safe, so a
restarted autoscaler resumes with the same history and does not flap).

``decide`` is a sequence of named pure phases, each returning a small frozen value (table-tested
one by one): :func:`tune_batch_caps` (rules 2, 4) -> :func:`capacity` (what one replica
computes: 14) -> :func:`aggregate` (the fleet: rules 1, 3, 16)
-> :func:`size` (replicas wanted now: 3, 4) -> :func:`forecast` (Holt over one model load: 11)
-> :func:`headroom` (the offered work's history and spikes: 15)
-> :func:`proven_work` and :func:`fewest_carrying` (what the fleet carries: 7, 14) ->
:func:`windows` (7, 8, 10) -> :func:`choose_replicas` (7-10, 12) -> :func:`queue_limits` (5,
12) -> :func:`conditions` -> :func:`next_state`. Rule 17 (SLO classes) changes the signals of
rules 2 and 5 inside :func:`tune_batch_caps` and :func:`aggregate` / :func:`queue_limits`.

Terms: TTFT (time to first token), TPOT (time per output token after the first), a request
*meets the SLO* when TTFT <= ``slo_ttft_s`` and TPOT <= ``slo_tpot_s`` (those of its SLO class
when it names one: rule 17); *goodput* is the rate of
such requests (DistServe, Zhong et al., OSDI 2024). *Attainment* is SLO-meeting requests over
OFFERED requests.

How each rule follows from the ideas it rests on:

1. Offered demand, not admitted demand. A fleet can look fast by refusing work, so demand is
   ``admitted + rejected_429 + router refused`` per second, and attainment is
   ``slo_met / (finished + rejected)`` (:func:`attainment`; rejected = the pods' 429s + the
   router's refusals): a refusal is a missed request. The chart's recording rule
   ``goodput:slo_attainment:ratio_rate<w>`` is the same ratio, and the dashboards read it.
   (400s, never_fits and invalid, are client errors that no replica count can fix; they are
   reported, not counted.) Requests the router holds (no ready pod) or queues (every pod at its
   limits) are demand in flight (Little's L): they add to ``running + waiting``.

2. The best batch is the largest that still meets the latency contract. Each replica's
   ``max_num_seqs`` is tuned AIMD-style from its own signals over the interval: TPOT attainment
   (``tpot.fraction_le(slo_tpot_s)``) below ``attainment_target`` or any preemption (the batch
   outgrew the KV pool) cuts it multiplicatively to ``floor(min(cap, running) * batch_decrease)``;
   when the cap binds (``running >= cap``), KV usage is below ``kv_target`` and nothing was
   preempted, it grows: by ``batch_fast_increase`` times while TPOT attainment holds at half the
   SLO (``fraction_le(slo_tpot_s * tpot_fast_margin) >= attainment_target``: far from the
   contract, step time grows only linearly with the batch), by ``max(1, ceil(cap *
   batch_increase))`` while it holds at ``tpot_margin`` of it, never past the batch whose KV,
   extrapolated from the KV per running request, reaches ``kv_target``. Otherwise it stays (too
   little evidence moves nothing). A new replica starts at the fleet's
   median learned cap (or at the batch it was ordered with, if larger: rule 4), so what one
   replica learned is not re-learned. While the window's spikes are short (rule 15,
   :func:`spikes_were_short`: they ended before capacity ordered for them could be ready), a TPOT
   miss cuts only below ``min(attainment_target, batch_decrease)`` of TPOT attainment
   (preemptions still always cut). Why:
   a cut to ``batch_decrease`` (d) times the batch lowers what the pod admits to about d of it (a
   request holds its slot for its whole decode, so at a given step time the completions are
   proportional to the batch; a smaller batch shortens a step only by its decode tokens, and in
   a spike most steps carry a full prefill chunk of the spike's arrivals), so its goodput after
   the cut is at most about d of what it admits now even if every request then meets its TPOT:
   from a TPOT attainment m >= d the cut loses goodput (d x 1 <= m). Outside short spikes the cut
   is still worth it, because the capacity it gives up comes back as replicas (the refusals it
   causes are rule 3's evidence, the smaller batch its Little's law), ready a model load later;
   during a spike that ends within a model load they come after it. Measured (h200, two-class,
   whose interactive class has a 50 ms TPOT that a step with a 512-token chunk, ~96 ms, misses):
   of the second burst's 1,769 requests (450-510 s) its 7 replicas met 1,108 (0.626) cutting
   below 0.9 and 1,242 (0.702) cutting below 0.75; attainment 0.680 -> 0.701 at the same 0.979
   replica-hours (frontier 0.665; with 5 % metric noise 0.665 -> 0.691).

3. Size from demand in flight (Little's law). The concurrency the fleet must carry is
   ``L = max(running + waiting now, offered_rps * service_s)`` with
   ``service_s = min(mean TTFT, slo_ttft_s) + (mean output tokens - 1) * mean TPOT``; one replica
   carries ``c = min(cap, running * kv_target / kv_usage)`` (the batch or, when KV binds first,
   what the KV pool holds at ``kv_target``) at ``target_utilization``. Wanted replicas
   ``w = ceil(L / (c_mean * target_utilization))``. A *calm* fleet (not saturated, attainment at
   target, nothing loading) is sized with the batch rule 2 would grow its cap to on the interval
   the cap binds (:func:`growth_room`): the learned batch is a floor, not a ceiling, so one
   replica at 3.5 req/s (47-54 sequences in flight under a learned cap of 64, which it carries
   at 0.998) is not sized at two. When attainment is below target while the
   fleet is saturated (waiting, preemptions, or 429s on more than ``tolerance`` of the interval's
   requests: under rule 5's token bound one long prompt queued behind another on one replica is
   refused while the fleet has room, and with 5 % metric noise one such refusal, while a burst's
   backlog drained at a noisy attainment of 0.62, ordered bursty's fleet from 6 to 9 replicas)
   and nothing is loading (misses while pods
   load are the expected cost of rule 4, not new evidence), ``w >= max(ready + 1, ceil(ready *
   attainment_target / attainment))`` (HPA's proportional formula applied to goodput; attainment
   floored at 0.25) (reason ScaleUpGoodput; ScaleUpSaturation when preemptions or KV over target
   are the signal). Little's law counts sequences, so it underrates prefill-heavy load (long
   prompts, short outputs); the attainment term is what sees that.

4. Starting pods are capacity that is coming. ``w`` is compared with ``current_replicas``, which
   counts pods that are loading or not yet created, never with the ready pods alone: demand that
   the loading pods will serve never adds replicas again (no pile-up while a model loads;
   reason HoldStarting). Coming capacity is counted with the batch and the TPOT it will have:
   those the scale-up that ordered it was sized with (``PolicyState.plan_cap``, the median
   learned cap, and ``plan_tpot_s``, the mean TPOT, of that decision; pods found loading without
   a plan get the caps in force before the tick and the TPOT of the tick). While anything is
   coming, every replica is sized with ``max(its cap, plan_cap)`` and service_s with
   ``min(mean TPOT, plan_tpot_s)``; a pod that becomes ready starts at ``max(plan_cap, median
   learned cap)``. Why: a TPOT miss during the load happens on the replicas that carry the
   overload the coming pods are ordered to absorb. It cuts their batch (rule 2), which protects
   the TPOT of the requests they admit now, and it stretches the measured service time; neither
   says that replicas at their planned load will need a smaller batch or serve slower, so
   neither may by itself order another replica (sized against the cut, one 64 -> 48 cut turns
   104 seqs from 2 replicas into 3). The offered rate is sized with ``min(offered, max(
   plan_offered_rps, admitted rate))``: while capacity loads the admission limits are tight on
   purpose (rule 5, and the cuts), and a client that retries a 429 offers the same request
   again, so 429s beyond the offered rate the plan was sized for are not new demand until the
   capacity has arrived (then they count in full). While pods load only a rise in demand (seqs
   in flight, admitted or planned req/s) adds replicas. For the same reason the cuts are provisional: on the tick the
   last coming pod is ready, every replica's cap is raised back to at least ``plan_cap`` (the
   load per replica is back to the planned one; if the batch still misses there, rule 2 cuts it
   again after one interval), and the plan is dropped. A cut or a slow TPOT that then persists
   counts in full, and its scale-up must still pass the scale-up window (rule 8) or be proven by
   missed SLOs on a saturated fleet (rule 3).

5. While capacity loads, admit only what can still meet TTFT. A waiting request at queue position
   k leaves the queue after about k / mu seconds, mu = c / service_s completions per second per
   replica, and then still needs ``t_first`` until its first token (its prefill, sharing each
   step's token budget with the batch): ``t_first`` = mean TTFT - mean queue time over the
   interval (the worker's queue-time histogram: arrival -> first scheduled). It meets TTFT when
   ``k / mu + t_first <= slo_ttft_s``, so ``k_ttft = floor((slo_ttft_s - t_first) * mu)``.
   (Spending the whole TTFT budget on the queue admits requests that wait their full budget and
   then miss by their prefill.) While pods are starting and the ready ones are saturated,
   the overload lasts the whole load time, so any request queued past k_ttft misses TTFT and
   only steals capacity: ``max_waiting = k_ttft`` (a fast 429 instead). With nothing loading a
   queue is transient noise that drains, so the limit loosens to ``k_ttft * queue_slack`` in
   proportion to the fraction of wanted capacity that is ready.
   The same budget in prompt tokens, always: a prefill-bound queue drains at the step's token
   budget, not at a rate of requests, so a request waits for the prompt tokens ahead of it (the
   waiting prompts and the running ones' remaining chunks) and then its own, at the replica's
   full-step rate r (rule 14's estimate, from its first measurement: a scale-down waits until the
   estimate is ready, admission does not, since a young estimate misplaces the bound only until
   the next call) times ``token_queue_scale`` (1.25: r errs low, a pod idle between steps measures
   less than a full step; at 1.0 one replica at a steady 3.5 req/s refused prompts that would have
   met their TTFT): ``max_waiting_tokens = floor(slo_ttft_s * r * token_queue_scale)`` (the worker
   refuses a prompt when the tokens ahead plus its own exceed it and something is ahead;
   ``Scheduler.prompt_tokens_ahead``). A count bounds a mix of prompt lengths badly: ten
   6,000-token prompts fill 12 s of an H200's prefill, ten 100-token ones 0.2 s; the token bound
   refuses the prompts that would miss and admits the ones that still fit, so what a saturated
   replica admits meets its TTFT. r is the full-step rate (prompt + decode tokens), so the bound
   errs high by the decode share of a step (R of the budget B). Measured (h200): azure-code 0.802
   -> 0.881 attainment at 6.28 -> 6.50 replica-hours (its first burst on 2-3 replicas: 41 -> 407
   of 531 requests met, 124 refused), long-prompt 0.849 -> 0.871 at 0.822 -> 0.581, two-class
   0.701 -> 0.717 and bursty 0.786 -> 0.787 at the same replica-hours (docs/autoscaling.md).

6. Preemptions are a saturation signal (they waste the recomputed prefill and stall TPOT): they
   cut the batch (rule 2) and block any scale-down.

7. Scale down only after the stabilization window, and only to a fleet predicted to carry the
   load with margin. The scale-down target is the LARGEST, over the last
   ``stabilization_window_s`` (Kubernetes HPA's scale-down stabilization), of each call's
   recommendation and of the fewest replicas that carried that call's load (``keep``,
   :func:`fewest_carrying`), over a history at least that long (a fresh or lost state waits a
   window); it applies only when there were no refusals and no preemptions in the interval,
   attainment met the target and nothing is starting. m replicas *carry* the load
   (:func:`carries`) when (a) Little's law: L, and L at the forecast (rule 11), fit m replicas at
   ``target_utilization``; (b) the work per replica they would get (offered tokens per second,
   prompt + output, at the smoothed load) is at most
   ``explore_ratio`` times (until rule 14's capacity estimate is ready; then rule 14's survivor
   check decides) the work per replica the fleet has *proven* (:func:`proven_work`: the
   least work per replica over a run of calls lasting a whole model-load time in which metrics
   were complete, nothing loaded, nothing saturated and attainment held), or the fleet is nearly
   idle (L at most ``idle_utilization`` of m replicas' capacity); and (c) below a learned floor,
   that work is under ``floor_release`` times the work that already failed there. Why (b):
   Little's law counts sequences, but a replica saturates on its step's token budget (prefill
   chunks) well before its batch is full: a steady 5 req/s that 2 H200s carry at 1.000 gets 0.63
   on one, whose batch is half empty; that knee depends on the hardware and the length mix, which
   the policy does not see. What the fleet has served within its SLO it can serve again, and a
   step of at most ``explore_ratio`` past it is a bounded experiment (3 -> 2 replicas raises the
   work per replica 1.5x; 2 -> 1, 2x, so a fleet of 2 goes to 1 only at a load one replica has
   carried, or nearly idle). Why the window keeps ``keep``: a lull shorter than the window (a
   Poisson dip) must not open a scale-down that the rest of the window's load forbids.
   Learning from an undone scale-down: a scale-up within ``stabilization_window_s`` of a
   scale-down records the work per replica that failed (``fail_work``; the proven work is cut
   below it) and a floor (the replicas after the scale-up). The floor decays one replica per
   ``floor_quiet_s`` without a new failure, so an N <-> N-1 flip-flop happens at most once.
   Successive scale-downs are at least one model-load time apart, and no scale-down comes within
   a model-load time of a scale-up or of a call that saw pods loading: undoing a wrong one costs
   a model load, and a scale-up's new pods are watched that long before any replica goes.

8. Scale up on evidence. The scale-up target is the SMALLEST recommendation of the last
   ``scale_up_window_s`` (a spike shorter than the window moves nothing), except that a
   recommendation from the load seen (not a forecast) of at least ``panic_ratio`` times the
   current replicas and at least two more (Knative's panic mode; at 1 replica a single noisy
   tick recommending 2 is not a panic: measured with 5 % metric noise on a steady 3.5 req/s that
   one replica carries at 0.998, it flipped 1 <-> 2 four times in 30 minutes, each scale-up just
   outside the window that would have learned from it), or one made while SLOs are being missed
   on a saturated fleet (the evidence is in), acts at once.

9. Bounded steps and a tolerance band. One decision adds at most ``max(max_scale_up_step,
   current)`` replicas and removes at most ``max_scale_down_step``; ``|w / current - 1| <=
   tolerance`` moves nothing (HPA's 10 % band). Limits move only by at least one unit.

10. Missing or stale metrics never cause a scale-down. If any ready pod is unreachable, or no ready
   pod has a rate yet (first scrape), ``MetricsAvailable`` is False and only a scale-up that the
   available pods prove is allowed (reason HoldMissingMetrics otherwise). Such a tick records
   ``max(w, current)`` in the windows (the pods that did not answer are assumed busy, as HPA
   assumes missing pods at 100 % of target on a scale-down): the stabilization window after the
   metrics come back then holds a whole window of complete metrics before any scale-down, where
   recording nothing would leave it empty after a gap longer than the window and let a single
   sample act. ``current_replicas`` below ``min_replicas`` is raised regardless
   (ScaleUpMinReplicas).

11. Predictive scale-up (:func:`forecast`). Offered load (req/s) follows Holt's linear trend
   (double exponential smoothing: level ``a``, trend ``b`` per second, ``forecast_alpha`` and
   ``forecast_beta`` per 5 s, compounded over the time between calls; Holt 1957; Hyndman &
   Athanasopoulos, *Forecasting: Principles and Practice*, section 8.2); mean prompt and output
   tokens per request follow simple exponential smoothing, slower (``length_alpha``: lengths vary
   from request to request far more than the mix drifts; the 5 s mean of lognormal prompts moves
   by +-25 %). The horizon is the model-load time, measured from the pods' creation
   -> Ready times (``PodObservation.load_s``, smoothed in ``PolicyState.load_s``; ``model_load_s``
   until one is seen): capacity ordered now is ready then. The forecast ``a + b * horizon`` (at
   most ``panic_ratio`` times the level, never below 0), sized by Little's law, is a
   recommendation like any other, so it passes the scale-up window (a single spike moves neither
   the smoothed level much nor the window's minimum) and it holds the scale-down window while
   load rises. Why Holt and not ARIMA or Prophet (predictors Dynamo's planner offers, fitted to a
   window of history) or a model fitted to a long history (AIBrix's predictive mode): the horizon
   is one model load (about a minute), over which a local level and slope is what there is to
   learn. Dynamo's Kalman predictor models exactly that (a local linear trend); Holt's method is
   its steady-state form with fixed gains: two numbers of state that survive a restart in
   ``PolicyState``, no covariance to keep, no training window, and with no trend it is the
   smoothed level. A seasonal model needs whole
   seasons (days) of history, which a per-service state in status does not keep; known daily
   peaks are better served by raising ``minReplicas`` on a schedule.

12. Scale from and to zero (with a router in front). ``current_replicas == 0`` and requests held
   by the router -> 1 replica at once (ScaleFromZero, no window). ``min_replicas == 0``, a router
   scraped, and nothing offered, held, queued or in flight for ``scale_to_zero_idle_s`` -> 0
   (ScaleToZeroIdle); without a router nothing could wake the service again, so it stays at 1.
   A pass that cannot see (a ready pod unreachable) counts as busy; a pass with no rates yet (a
   first scrape: new pods, a restarted autoscaler, a new leader) is no evidence either way and
   moves no idle clock (scale to zero itself still waits for rates).
   The router's fleet-queue bound ``router_max_queued`` is rule 5's TTFT bound applied to the
   fleet's service rate: ``floor((slo_ttft_s - t_first) * mu * ready)``.

13. Every knob is declared once, as a field of :class:`~goodput.api.policy.PolicySpec` (the
   contract package: the operator's CRD reads it too) with a :class:`~goodput.api.policy.Knob`
   (help, bounds, where the InferenceService holds it, unit); the CRD's ``spec.autoscaling`` and
   ``spec.slo`` fields, :meth:`PolicySpec.from_crd` and the defaults derive from it
   (:func:`~goodput.api.policy.knobs`). A new knob is one new field.

14. Capacity per replica, and survivor-load scale-down (:func:`capacity`, :func:`carries`).
   A step computes at most its token budget B; while a prompt is prefilled each step carries a
   chunk of it plus one decode token per running request (R), so with step time t the prompt
   advances at (B - R) / t tokens/s and the decodes at R / t, the generated tokens per second:
   their sum is the replica's throughput at a full step, B / t, at any load. Each pod measures it
   (:func:`pod_token_rate`): mean prompt (prompt tokens / admitted) over the mean prefill time
   (the TTFT histogram's mean less the queue-time histogram's) plus generated tokens per second.
   It errs low rather than high (a pod idle between steps, prompts shorter than a chunk). The fleet's
   mean is smoothed with its variance (``length_alpha`` per 5 s; West's weighted variance); the
   estimate is *ready* after one model-load time of calls, its uncertainty is the smoothed mean's
   standard deviation ``sd``, and a scale-down may plan to fill ``usable = token_utilization x
   estimate x cap_scale x (1 - capacity_margin_sd x sd / estimate)`` tokens/s per replica. N ->
   N - 1 (any m < N) goes when the survivors' work, the offered tokens/s (the mean over the last
   horizon, or at the spike headroom when rule 15 sees a spike) divided by m, i.e. N / m times today's work per
   replica, is within ``max(usable, proven_work)``: what the fleet proved inside the SLO (rule 7)
   is a lower bound that tightens the estimate. With a ready estimate this replaces rule 7's
   ``explore_ratio`` step past the proof (kept until the estimate is ready); Little's law, the
   learned floor, the windows and the spacing of rule 7 still apply. Undone fast: a scale-up within
   the stabilization window of a scale-down leaves rule 7's floor and ``fail_work`` and scales the
   estimate (``cap_scale``) so that ``usable`` falls to ``(1 - tolerance)`` x the work per replica
   that failed; ``cap_scale`` returns to 1 when the floor has decayed away. Measured (h200,
   60 s load, steady Poisson, prompts 512 / outputs 128 median): the estimate settles at
   4,700-5,000 tokens/s (a full 512-token step takes ~100 ms), ``sd`` 30-90; one replica
   carries 4.5 req/s (~3,800 tokens/s) at 0.983 and 5 req/s at 0.63.

15. Spike headroom (:func:`headroom`, :func:`peak_to_mean`): capacity ordered when a spike starts
   is ready a model load later, so a spike no longer than that is served by what runs. Each call
   records its offered work; over ``headroom_window_s`` the *short-term peak-to-mean ratio* is the
   largest mean work of any run of calls one horizon long, less ``SPIKE_NOISE_SD`` times its own
   arrival noise, over the window's mean work; a scale-down must leave capacity (Little's law
   and the survivor check) for ratio x mean, and a lull between spikes is not idle: the idle
   shortcut of rule 7 applies only when the spike's work fits too. On a steady load the ratio is
   1 (its cost there is nothing). *Short spikes* (:func:`short_spikes`, :func:`short_spike_limit`):
   when the spikes the window saw before the last horizon ended before capacity ordered for them
   could be ready (a scale-up is ordered at the earliest on the first call that sees a spike, up
   to one call interval P after it began, and is ready H later, so a spike lasting d <= H + P
   can end first; one of height A raises the one-horizon peak by A min(d, H) / H and the
   two-horizon peak by A d / 2H, so ``r2 - 1 <= (SHORT_SPIKE + P / 2H) (r1 - 1)``,
   ``SHORT_SPIKE`` 0.5, P the history's median call interval: 0.542 at 5 s calls and a 60 s load;
   a rise that outlasts a model load has r2 close to r1 and is left alone), capacity ordered
   during the spike under way is ready after it ends and can only serve a later one, which needs the
   window's spike work at the measured full-step capacity: a scale-up goes no further than
   ``max(current, ceil(ratio x mean work / (estimate x cap_scale)))`` (reason HoldShortSpike when
   that is ``current``), and rule 2 cuts a batch only from a TPOT attainment below
   ``batch_decrease`` (the batch a cut gives up cannot come back as replicas before the spike
   ends). The first spike of a window is left to the scale-up rules. Window
   ``headroom_window_s`` 1800 s (0: off; off, the history still covers the stabilization window
   and the survivors' work is judged on the last horizon's mean, not on the noisy level).
   Measured (h200, 60 s load): long-prompt 0.849 attainment at 0.822 replica-hours (off: 0.849
   at 0.926, the 3 replicas ordered 25 s into the second 60 s spike were ready after it);
   azure-code 0.802 at 6.28, frontier 0.832 (off: 0.781 at 6.77; the lull fix keeps the capacity
   of the last burst through the next lull instead of stepping down to 5 before each burst; with
   spikes short only up to d <= H, 0.834 at 7.39, frontier 0.882: its first burst, at r2 - 1 =
   0.52 (r1 - 1) just over one load, was not short, so the second ordered 6 -> 10, ready after it
   ended, and the headroom kept the 10 for 1,700 s).

16. Infeasible requests do not pin replicas. A prompt longer than ``p_max = slo_ttft_s x
   estimate x (1 + margin)`` tokens cannot get its first token within the TTFT SLO even on an idle
   replica (the estimate is the full-step prefill speed, rule 14; the margin errs towards
   feasible). The prompt-length histogram (``goodput_request_prompt_tokens``, per finished
   request) counts them (:func:`infeasible`); they are left out of the attainment the sizing
   reads (``slo_met / (finished + rejected - infeasible)``: their misses are no evidence that
   replicas would help), reported in ``Decision.infeasible``, the decision message, a Warning
   Event series ``InfeasibleRequests`` and the counter
   ``goodput_autoscaler_infeasible_requests_total``. Their work still counts in the load.

17. SLO classes: each request is held to its own class's SLO (``spec.slo_classes``, the CRD's
   ``spec.slo.classes``; a request names its class in the ``x-goodput-slo-class`` header, none or
   an unknown name is the default class, ``slo_ttft_s`` / ``slo_tpot_s``). The worker judges
   ``slo_met`` per class, so attainment (rule 1) and the evidence of rule 3 are per class already;
   it also counts, per class, the finished requests and those meeting their own class's TPOT
   (``PodObservation.class_finished``, ``class_tpot_met``). With classes declared and counted:
   (a) rule 2's TPOT signal is the fraction of finished requests meeting their OWN class's TPOT,
   ``sum(class_tpot_met) / sum(class_finished)`` (:func:`tpot_met`), not the TPOT histogram's
   fraction at the strictest TPOT: a batch request at 150 ms meets its 200 ms class and is no
   reason to cut the batch; (b) rule 2's growth margins are taken of the strictest TPOT among the
   classes that finished requests on the pod (:func:`strictest_tpot`): every request in a step
   waits for the same step, so the batch grows only while every class present keeps its TPOT;
   (c) rule 5's TTFT budget is the strictest TTFT among the classes present (:func:`queue_ttft`:
   a class that finished requests over the interval or within the last stabilization window,
   ``PolicyState.class_seen``, so a strict class whose requests are sparse, or all still running,
   keeps holding the queue), not ``slo_ttft_s``: the worker admits waiting requests by class band,
   tightest TTFT first, and refuses a request when ``max_waiting`` requests of its band or a
   tighter one wait (``Scheduler.queued_ahead``), so a request of the strictest class waits behind
   at most k others of its band, k / mu, and a looser class is refused first (with the worker's
   earlier first-in first-out queue, a queue sized from the class mix let batch requests make
   every interactive one behind them late: on the simulator's two-class trace a 5 s budget gave
   0.590 attainment and a 1.5 s one 0.633, against 0.763 with the strictest class's 0.5 s). A service whose strict class
   sends nothing queues for the looser ones. Without classes, or with a worker that does not
   export the per-class counters, rules 2 and 5 read exactly as above (bit for bit).

18. The prefill pool of a disaggregated service (``spec.prefill_pool``, set by the loop's
   ``pool_policy`` for that pool only) is sized by prompt tokens (:func:`prefill_size`). Its pods
   report no TPOT, so rules 3 and 5 had no service time and only rule 4's attainment evidence
   moved it: that lags a backlog (a cold start ordered 1 -> 4, then counted the queued requests'
   misses again when the 4 arrived and went to 8). A prefill pod computes its prompts one after
   another at full-step speed: a request occupies it ``service_s`` (the shorter of the interval's
   prefill time, TTFT less queue time, and the mean prompt over rule 14's estimate), one replica
   carries one at a time, and the pool wants ``ceil(level_rps * service_s / token_utilization)``
   replicas at rule 11's smoothed rate: the offered prompt tokens over what one replica computes.
   Rule 5 bounds each prefill pod's queue with the same service time (``mu = 1 / service_s``), so
   while capacity loads the pods keep their TTFT and refuse the rest (the router then has the
   decode pod prefill it) instead of queueing requests that can no longer make it. The evidence
   of rule 4 adds one replica at a time, and not while a ready pod is younger than the interval
   plus ``queue_slack`` TTFT SLOs: misses of requests that queued before ordered capacity
   arrived are no new evidence.
   The first rate of a cold pool (:func:`backlog_rate`): rule 11's level starts at the first
   interval's count, and the first order, made at once (rule 8's panic), rests on it and holds
   through the stabilization window. A pod's first scrape gives no delta, so what arrived before
   that interval is not counted; a queueing prefill pod holds it. Over its age A (at most two
   intervals), arrivals = what it holds + what it served: ``(running + waiting) / A +
   first tokens / interval``, a count over A instead of one interval, used as the level's first
   value while every ready pod queues and nothing was refused or is coming. Measured (h200,
   long-context, seed 0): the first interval counted 18 arrivals (3.6 req/s; the trace's mean
   2.88) and 5 prefills of 5,178-token prompts (the trace's mean 4,242) at 1.07 s:
   ``ceil(3.6 x 1.07 / 0.8) = 5``, one more than the best fixed split (4:1), and the stabilization
   window, whose maximum over the recommendations, the forecasts and the fewest replicas carrying
   the load reached 5 and 6 again, kept 5 for the whole 600 s (1.19x the split's replica-hours).
   Over the pod's 10 s: (1 + 17) / 10 + 5 / 5 = 2.8 req/s -> ``ceil(3.76) = 4``; seed 1's light
   first interval (8 arrivals, 16 in flight) reads 2.4 req/s instead of 1.6 (4 ordered, was 3).
   Rule 14's estimate of a prefill pod (:func:`pod_token_rate`) takes its mean prompt from the
   prompt-length histogram, whose requests (finished with their first token) are the ones the
   TTFT histogram timed; the prompt counter over the admissions counts arrivals that still wait,
   so a cold pod's first sample read 1,385 tokens/s where its prefills ran at 4,821, and rule 5's
   token bound (the TTFT SLO times the estimate: 4,154 tokens from that sample on, 9,241 when the
   ordered pods had arrived, where 14,400 was due) refused prompts the pods had time for: the
   decode pod prefilled them and, its TPOT missed, the decode pool went 1 -> 3 (long-context,
   seed 0: 1.28x the best split's replica-hours).

19. The decode pool of a disaggregated service waits for the prefill capacity on its way
   (:func:`prefill_relief`). When the prefill pool refuses a prompt or has no ready pod, the
   router has the decode pod prefill it itself; the observation carries those requests
   (``Observation.prefill_fallback``, the router's ``prefill_failed`` and ``no_prefill_pod``
   decisions over the interval) and the prefill pods ordered and not ready yet
   (``Observation.prefill_coming``). From a call with both, until the prefill pods have arrived
   (``prefill_coming`` 0): (a) the decode pool neither scales up nor down (reason
   HoldPrefillStarting): its TPOT misses come from prompts that are the prefill pool's work, and
   the capacity for them is loading there (decode pods ordered for them were ready after the
   prefill pods, and then held through the stabilization window: 1 -> 4 decode pods for a trace
   that one carries); (b) rule 2's cuts still protect the TPOT of what the pods admit, but they
   are provisional as in rule 4: the median learned cap before the first such call
   (``PolicyState.relief_cap``) is the batch the pods are sized with meanwhile, and every cap is
   raised back to at least it on the call the prefill pods have arrived (a decode pod cut to 5 by
   local 4k-token prefills otherwise regrows one sequence per interval, queueing the decodes the
   prefill pool now sends it). The hold lasts one interval plus ``queue_slack`` TTFT SLOs past that
   call (``PolicyState.relief_until``): the requests the pods admitted meanwhile finish then, and
   their misses are no evidence about the decode pool (rule 18's settling). Without fallbacks, or with nothing coming in the prefill pool (it is
   at its maximum: the local prefills are then the decode pool's work), rules 1-17 read as above.
"""
from __future__ import annotations

import math
import statistics
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from goodput.api.policy import PolicySpec

# ----------------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class HistogramDelta:
    """Increase of a Prometheus histogram over one interval.

    bounds: bucket upper bounds in seconds, ascending, the last one ``math.inf``.
    counts: cumulative counts per bound (same length; ``counts[-1]`` is the +Inf bucket).
    count, sum: the ``_count`` and ``_sum`` increases (observations, seconds).
    Raises ValueError when bounds and counts differ in length or bounds are not ascending.
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    count: float
    sum: float

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.counts) or not self.bounds:
            raise ValueError(f"bounds ({len(self.bounds)}) and counts ({len(self.counts)}) must be "
                             "non-empty and of equal length")
        if any(b <= a for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"bounds must be strictly ascending, got {self.bounds}")

    def fraction_le(self, x: float) -> float | None:
        """Fraction of the interval's observations <= ``x`` seconds; None when there were none.

        Linear interpolation inside the bucket holding ``x`` (as Prometheus'
        ``histogram_quantile`` assumes; the first bucket starts at 0). Beyond the last finite
        bound nothing can be interpolated, so the count up to that bound is used (a lower bound).
        """
        total = self.counts[-1] if self.counts[-1] > 0 else self.count
        if total <= 0:
            return None
        prev_bound, prev_count = 0.0, 0.0
        for bound, cum in zip(self.bounds, self.counts):
            if x <= bound:
                if math.isinf(bound):
                    frac = prev_count
                else:
                    width = bound - prev_bound
                    part = (x - prev_bound) / width if width > 0 else 1.0
                    frac = prev_count + (cum - prev_count) * max(0.0, part)
                return min(1.0, max(0.0, frac / total))
            prev_bound, prev_count = bound, cum
        return min(1.0, prev_count / total)

    @property
    def mean(self) -> float | None:
        """Mean observation in seconds (sum / count); None when count is 0."""
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True)
class PodObservation:
    """One READY pod, from one scrape and the deltas to the previous scrape.

    running, waiting: requests now (gauges). kv_usage: KV blocks in use, 0..1.
    max_num_seqs, max_waiting: admission limits in force on the pod.
    interval_s: seconds between the two scrapes the deltas come from (0 = first scrape: the
        deltas are meaningless and ignored).
    admitted, finished, slo_met, rejected_429 (queue_full), rejected_400 (never_fits + invalid),
        preempted, generation_tokens: counter increases over the interval.
    ttft, tpot: histogram increases over the interval (None when not scraped).
    age_s: seconds since the pod became ready.
    queue: histogram increase of the queue time (arrival -> first scheduled, seconds) over the
        interval (None when not scraped; rule 5 then assumes no time after the queue).
    load_s: seconds from the pod's creation to Ready (its model load; None when unknown). Rule 11's
        horizon is learned from it.
    prompt_tokens: increase of ``goodput_prompt_tokens_total`` over the interval (None when not
        scraped: the work per replica of rule 7 then counts output tokens only).
    prompt_len: histogram increase of the prompt tokens per finished request over the interval
        (bounds in tokens; None when not scraped: rule 16 then counts no request infeasible).
    class_finished, class_tpot_met: SLO class name -> increases over the interval of the finished
        requests (stop/length) of that class and of those among them meeting their own class's
        TPOT SLO (``goodput_requests_{finished,tpot_met}_by_class_total``; the unnamed class is
        ``default``). None when not scraped (a worker without SLO classes): rules 2 and 5 then
        read the TPOT histogram against ``slo_tpot_s`` and the TTFT budget of ``slo_ttft_s``
        (rule 17).
    """

    name: str
    running: int
    waiting: int
    kv_usage: float
    max_num_seqs: int
    max_waiting: int
    interval_s: float
    admitted: float
    finished: float
    slo_met: float
    rejected_429: float
    rejected_400: float
    preempted: float
    generation_tokens: float
    ttft: HistogramDelta | None
    tpot: HistogramDelta | None
    age_s: float = 0.0
    queue: HistogramDelta | None = None
    load_s: float | None = None
    prompt_tokens: float | None = None
    prompt_len: HistogramDelta | None = None
    class_finished: Mapping[str, float] | None = None
    class_tpot_met: Mapping[str, float] | None = None


@dataclass(frozen=True)
class StartingPod:
    """A pod created but not ready yet (model loading); ``age_s`` since it was created."""

    name: str
    age_s: float


@dataclass(frozen=True)
class RouterObservation:
    """The routers in front of one service, summed over router replicas (the contract's
    ``goodput_router_*`` gauges and counter).

    held: requests held now because no pod is Ready (scale from zero). queued: requests in the
    router's fleet queue now (every pod at its limits). refused: router 429s over the interval
    since the previous observation (requests). pd_fallback: requests the routers had a decode pod
    prefill itself over the interval because no prefill pod was ready or the one picked refused
    (``goodput_router_pd_decisions`` ``no_prefill_pod`` + ``prefill_failed``; rule 19).
    """

    held: int
    queued: int
    refused: float
    pd_fallback: float = 0.0


@dataclass(frozen=True)
class Observation:
    """The fleet at one instant.

    ready: scraped ready pods. starting: pods not ready yet. unreachable: names of ready pods whose
    scrape failed, timed out or is stale. current_replicas: ``spec.replicas`` as the API server
    has it now (it also counts pods not created yet). router: the routers' view (None when no
    router is scraped). prefill_fallback, prefill_coming (the decode pool of a disaggregated
    service, rule 19; 0 elsewhere): requests this pool's pods prefilled themselves over the interval
    because the prefill pool refused them or had no ready pod, and the prefill pods ordered and not
    ready yet.
    """

    ready: tuple[PodObservation, ...]
    starting: tuple[StartingPod, ...]
    unreachable: tuple[str, ...]
    current_replicas: int
    router: RouterObservation | None = None
    prefill_fallback: float = 0.0
    prefill_coming: int = 0


def attainment(slo_met: float, finished: float, rejected: float) -> float | None:
    """THE attainment: requests meeting both SLOs over requests offered and not dropped by the
    client, ``slo_met / (finished + rejected)`` (rejected: 429s of the pods and of the router).
    None when nothing finished or was refused (no requests: no evidence either way, never NaN).
    The chart's recording rule ``goodput:slo_attainment:ratio_rate<w>`` computes the same ratio.
    """
    offered = finished + rejected
    return slo_met / offered if offered > 0 else None


# ----------------------------------------------------------------------------------------- state


@dataclass
class PolicyState:
    """What ``decide`` remembers between calls (JSON-safe through ``to_dict``/``from_dict``).
    Times are the caller's clock (seconds).

    recommendations: ``[time, replicas, keep]``, newest last, kept for the longest window (keep:
        the fewest replicas that carried the load then, rule 7; absent in older states).
    caps: pod name -> learned ``max_num_seqs`` (the best batch, rule 2).
    service_s: last estimate of the service time of one request (seconds; 0 = unknown).
    last_scale_time: when replicas last changed (None = never). last_direction: +1, -1 or 0.
    last_up_time, last_down_time: the last scale-up / scale-down (None = never).
    last_loading_time: the last call that saw pods loading (None = never).
    plan_cap, plan_tpot_s, plan_offered_rps: the batch (``max_num_seqs``) per replica, the mean
        TPOT (seconds) and the offered load (req/s) that the capacity now coming was sized with
        (rule 4); 0 when nothing is coming.
    since: when this history started (the first call with metrics); no scale-down before a whole
        stabilization window of history exists, so an autoscaler that lost its state waits
        instead of acting on one sample.
    last_tick: the previous call with metrics (the router's refusals are spread over the time
        since). level_rps, trend_rps: Holt's level (req/s) and trend (req/s per second) of the
        offered load; prompt_level, output_level: smoothed tokens per request (rule 11).
    load_s: measured model-load time, smoothed (seconds; 0 = none measured yet).
    proven_work: the most offered tokens/s per replica sustained while the SLO held (rule 7);
        proof: ``[time, tokens/s per replica]`` of the current run of good calls.
    fail_work, floor, floor_time: the work per replica at which a scale-down had to be undone, the
        replicas it took, and when (floor 0 = none).
    last_busy: the last call with anything offered, held, queued or in flight (rule 12).
    cap_tokens, cap_var, cap_seen_s: the capacity estimate of one replica (rule 14): smoothed
        token throughput at a full step (tokens/s), the smoothed variance of the per-call estimate
        (tokens/s squared), and the seconds of calls it rests on. cap_scale: what an undone
        scale-down taught (the estimate is multiplied by it, <= 1; back to 1 with the floor).
    work_history: ``[time, seconds, offered tokens, offered requests]`` per call with metrics
        over the last ``headroom_window_s`` (rule 15).
    class_seen: SLO class name -> the last call at which a request of that class finished (rule
        17; kept one stabilization window).
    relief_cap: the median learned cap before the decode pod's prefills in place of a loading
        prefill pool began (rule 19; 0 = none under way). relief_until: the decode pool holds until
        then after it (rule 19; None = not settling).
    """

    recommendations: list[list[float]] = field(default_factory=list)
    caps: dict[str, int] = field(default_factory=dict)
    service_s: float = 0.0
    last_scale_time: float | None = None
    last_direction: int = 0
    since: float | None = None
    plan_cap: int = 0
    plan_tpot_s: float = 0.0
    plan_offered_rps: float = 0.0
    last_up_time: float | None = None
    last_down_time: float | None = None
    last_loading_time: float | None = None
    last_tick: float | None = None
    level_rps: float | None = None
    trend_rps: float = 0.0
    prompt_level: float = 0.0
    output_level: float = 0.0
    load_s: float = 0.0
    proven_work: float = 0.0
    proof: list[list[float]] = field(default_factory=list)
    fail_work: float = 0.0
    floor: int = 0
    floor_time: float | None = None
    last_busy: float | None = None
    cap_tokens: float = 0.0
    cap_var: float = 0.0
    cap_seen_s: float = 0.0
    cap_scale: float = 1.0
    work_history: list[list[float]] = field(default_factory=list)
    class_seen: dict[str, float] = field(default_factory=dict)
    relief_cap: int = 0
    relief_until: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types only (lists, dicts, numbers, None)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "PolicyState":
        """Inverse of ``to_dict``; unknown keys are ignored, missing ones take their defaults, and a
        malformed dict gives a fresh state (a corrupt status must not crash the loop)."""
        if not isinstance(d, Mapping):
            return cls()
        hints = typing.get_type_hints(cls)
        kw: dict[str, Any] = {}
        try:
            for f in fields(cls):
                if f.name not in d:
                    continue
                v, t = d[f.name], hints[f.name]
                if f.name in ("recommendations", "proof"):
                    kw[f.name] = [[float(x) for x in e] for e in v if 2 <= len(e) <= 3]
                elif f.name == "work_history":
                    kw[f.name] = [[float(x) for x in e] for e in v if len(e) == 4]
                elif f.name == "caps":
                    kw[f.name] = {str(k): int(x) for k, x in (v or {}).items()}
                elif f.name == "class_seen":
                    kw[f.name] = {str(k): float(x) for k, x in (v or {}).items() if math.isfinite(float(x))}
                elif v is None and type(None) in typing.get_args(t):
                    kw[f.name] = None
                else:
                    base = int if t is int else float
                    x = base(v)
                    if base is float and not math.isfinite(x):
                        raise ValueError(f"{f.name} is not finite")
                    kw[f.name] = x
            return cls(**kw)
        except (TypeError, ValueError, AttributeError):
            return cls()


@dataclass(frozen=True)
class Limits:
    """Admission limits for one replica (``PUT /admin/limits``); max_waiting_tokens: prompt tokens
    queued for prefill (0 = no token bound)."""

    max_num_seqs: int
    max_waiting: int
    max_waiting_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    """What ``decide`` returns.

    replicas: the ``spec.replicas`` to set (unchanged = current).
    limits: pod name -> limits for every ready pod.
    reason: CamelCase (ScaleUpGoodput, ScaleUpSaturation, ScaleUpForecast, ScaleUpMinReplicas,
        ScaleFromZero, ScaleDownMaxReplicas, ScaleDownIdle, ScaleDown, ScaleToZeroIdle,
        HoldStarting, HoldStabilizing, HoldMissingMetrics, HoldShortSpike, HoldPrefillStarting,
        Steady).
    message: one sentence with the numbers behind the decision, from ``"<current> -> <replicas>
        replicas (...)"`` on; not its reason (``reason`` says it), not the limits (the loop appends
        the ones in force after the spec's bounds: ``loop.decision_message``).
    conditions: type -> (status, reason, message) for MetricsAvailable, ScalingActive, AbleToScale.
    state: the state to pass to the next call.
    router_max_queued: the bound of the router's fleet queue (``status.admission.routerMaxQueued``;
        None when no ready pod gives a service rate).
    infeasible: requests over the interval whose TTFT SLO one idle replica cannot meet (rule 16;
        counted, kept out of the attainment the sizing reads).
    capacity_tokens: the capacity estimate of one replica, tokens/s at a full step, after what
        undone scale-downs taught (rule 14; 0 = not enough evidence yet).
    """

    replicas: int
    limits: dict[str, Limits]
    reason: str
    message: str
    conditions: dict[str, tuple[bool, str, str]]
    state: PolicyState
    router_max_queued: int | None = None
    infeasible: float = 0.0
    capacity_tokens: float = 0.0


# -------------------------------------------------------------------------------- phase helpers


def _pod_service_s(p: PodObservation, slo_ttft_s: float, tpot_ceiling_s: float = math.inf
                   ) -> float | None:
    if p.interval_s <= 0 or p.finished <= 0 or p.tpot is None or p.tpot.mean is None:
        return None
    ttft = p.ttft.mean if p.ttft is not None and p.ttft.mean is not None else 0.0
    out = max(1.0, p.generation_tokens / p.finished)
    return min(ttft, slo_ttft_s) + (out - 1.0) * min(p.tpot.mean, tpot_ceiling_s)


def _classes_seen(p: PodObservation, spec: PolicySpec) -> bool:
    """Rule 17: the pod reports per-class counters and the spec declares classes."""
    return bool(spec.slo_classes) and p.class_finished is not None and p.class_tpot_met is not None


def tpot_met(p: PodObservation, spec: PolicySpec) -> float | None:
    """Rule 2's TPOT attainment over the interval, 0..1 (None: nothing finished). Without SLO
    classes: the TPOT histogram's fraction at ``slo_tpot_s``. With them (rule 17): the fraction of
    finished requests meeting their OWN class's TPOT, ``sum(class_tpot_met) / sum(class_finished)``
    (a batch request at 150 ms meets a 200 ms class, whatever the strictest class asks)."""
    if _classes_seen(p, spec):
        fin = sum(p.class_finished.values())
        return min(1.0, max(0.0, sum(p.class_tpot_met.values()) / fin)) if fin > 0 else None
    return p.tpot.fraction_le(spec.slo_tpot_s) if p.tpot is not None else None


def strictest_tpot(p: PodObservation, spec: PolicySpec) -> float:
    """The TPOT (seconds) rule 2's growth margins are taken of: ``slo_tpot_s``; with SLO classes
    (rule 17) the strictest TPOT among the classes that finished requests on the pod over the
    interval (``slo_tpot_s`` when none did): the batch grows only while every class present would
    keep its TPOT (the step time is shared by the whole batch)."""
    if not _classes_seen(p, spec):
        return spec.slo_tpot_s
    slos = spec.class_slos()
    present = [slos[c][1] for c, n in p.class_finished.items() if n > 0 and c in slos]
    return min(present) if present else spec.slo_tpot_s


def tune_cap(p: PodObservation, cap: int, spec: PolicySpec, short: bool = False) -> int:
    """Rule 2 (AIMD on the best batch) for one pod: the cap after this interval's evidence.
    ``short``: the window's spikes are short (:func:`spikes_were_short`); a TPOT miss then cuts
    only below ``min(attainment_target, batch_decrease)`` of TPOT attainment (a cut by d can raise
    the goodput only from below d, and the capacity it gives up cannot come back as replicas
    before the spike ends)."""
    if p.interval_s <= 0 or p.tpot is None:
        return cap
    tpot_ok = tpot_met(p, spec)
    cut_below = min(spec.attainment_target, spec.batch_decrease) if short else spec.attainment_target
    if p.preempted > 0 or (tpot_ok is not None and tpot_ok < cut_below):
        base = min(cap, max(p.running, spec.min_num_seqs))
        return max(spec.min_num_seqs, min(cap - 1, math.floor(base * spec.batch_decrease)))
    if p.running < cap or p.kv_usage >= spec.kv_target:
        return cap          # the cap does not bind, or KV binds first: no evidence to grow
    # KV at the new cap, extrapolated from KV per running request now, must stay <= kv_target
    kv_room = math.floor(p.running * spec.kv_target / p.kv_usage) if p.kv_usage > 0 else spec.max_num_seqs
    tpot_ref = strictest_tpot(p, spec)
    fast = p.tpot.fraction_le(tpot_ref * spec.tpot_fast_margin)
    margin = p.tpot.fraction_le(tpot_ref * spec.tpot_margin)
    if fast is not None and fast >= spec.attainment_target:
        grown = math.ceil(cap * spec.batch_fast_increase)
    elif margin is not None and margin >= spec.attainment_target:
        grown = cap + max(1, math.ceil(cap * spec.batch_increase))
    else:
        return cap
    return max(cap, min(spec.max_num_seqs, grown, kv_room))


def growth_room(p: PodObservation, cap: int, spec: PolicySpec) -> int:
    """Rule 3: the batch rule 2 would grow ``cap`` to on the interval it binds, from this interval's
    evidence (TPOT within the fast margin: ``ceil(cap * batch_fast_increase)``; within
    ``tpot_margin``: ``cap + max(1, ceil(cap * batch_increase))``), never past ``max_num_seqs`` or
    the batch whose KV, extrapolated from the KV per running request, reaches ``kv_target``;
    ``cap`` itself without TPOT evidence, after a preemption or a TPOT miss."""
    if p.interval_s <= 0 or p.tpot is None or p.preempted > 0:
        return cap
    ok = tpot_met(p, spec)
    tpot_ref = strictest_tpot(p, spec)
    fast = p.tpot.fraction_le(tpot_ref * spec.tpot_fast_margin)
    margin = p.tpot.fraction_le(tpot_ref * spec.tpot_margin)
    if ok is None or ok < spec.attainment_target:
        return cap
    if fast is not None and fast >= spec.attainment_target:
        grown = math.ceil(cap * spec.batch_fast_increase)
    elif margin is not None and margin >= spec.attainment_target:
        grown = cap + max(1, math.ceil(cap * spec.batch_increase))
    else:
        return cap
    kv_room = math.floor(p.running * spec.kv_target / p.kv_usage) if p.kv_usage > 0 and p.running > 0 \
        else spec.max_num_seqs
    return max(cap, min(spec.max_num_seqs, grown, kv_room))


def replica_capacity(p: PodObservation, cap: int, spec: PolicySpec) -> float:
    """Rule 3: concurrency one replica carries within the contract (batch or KV at kv_target)."""
    c = float(cap)
    if p.kv_usage > 0 and p.running > 0:
        c = min(c, p.running * spec.kv_target / p.kv_usage)
    return max(float(spec.min_num_seqs), c)


def _median(xs: list[int]) -> int:
    s = sorted(xs)
    return s[len(s) // 2] if s else 0


def _mean(xs: list[float], default: float) -> float:
    return sum(xs) / len(xs) if xs else default


# ------------------------------------------------------------------------ phase 1: batch caps


@dataclass(frozen=True)
class BatchCaps:
    """Rule 2 and 4. caps: pod -> learned ``max_num_seqs`` (unreachable pods keep theirs);
    sizing: pod -> the batch it is sized with (a cut while capacity is coming does not shrink it);
    coming: pods loading or not yet created; plan_cap: the batch the coming capacity was sized
    with (0 = none); relief_cap: the batch before the decode pods began to prefill in place of a
    loading prefill pool (rule 19; 0 = none under way)."""

    caps: Mapping[str, int]
    sizing: Mapping[str, int]
    coming: int
    plan_cap: int
    relief_cap: int = 0


def prefill_relief(obs: Observation, st: PolicyState) -> bool:
    """Rule 19: is the decode pool waiting for prefill capacity on its way? From a call whose pods
    prefilled in place of the prefill pool (``obs.prefill_fallback``) while prefill pods were
    loading (``obs.prefill_coming``), until a call with none loading and no such prefill (the
    interval in which the prefill pods arrived still holds the pods' last local prefills)."""
    if st.relief_cap > 0:
        return obs.prefill_coming > 0 or obs.prefill_fallback > 0
    return obs.prefill_coming > 0 and obs.prefill_fallback > 0


def tune_batch_caps(obs: Observation, spec: PolicySpec, st: PolicyState) -> BatchCaps:
    """Phase 1: each ready pod's best batch (rule 2; a TPOT miss cuts less readily while the
    window's spikes are short, :func:`spikes_were_short`) and the batch it is sized with (rule 4)."""
    short = spikes_were_short(st, spec)
    n_ready = len(obs.ready)
    coming = len(obs.starting) + max(0, obs.current_replicas - n_ready - len(obs.unreachable)
                                     - len(obs.starting))
    plan_cap = st.plan_cap
    if coming > 0 and not plan_cap:
        # loading found without a plan of ours (created elsewhere, or state lost): the batch in
        # force before this tick's cuts is the one it will have
        plan_cap = _median([st.caps.get(p.name) or p.max_num_seqs for p in obs.ready])
    fleet_cap = max(plan_cap, _median(list(st.caps.values()))) or None
    arrived = coming == 0 and plan_cap > 0   # cuts made while loading were provisional (rule 4)
    relief = prefill_relief(obs, st)         # so are those while the prefill pool loads (rule 19)
    relief_cap = (st.relief_cap or _median([st.caps.get(p.name) or p.max_num_seqs for p in obs.ready])) \
        if relief else 0
    relieved = st.relief_cap if not relief else 0
    caps: dict[str, int] = {}
    for p in obs.ready:
        start = st.caps.get(p.name) or fleet_cap or p.max_num_seqs
        if arrived:
            start = max(start, plan_cap)
        if relieved:
            start = max(start, relieved)
        caps[p.name] = tune_cap(p, max(spec.min_num_seqs, min(spec.max_num_seqs, start)), spec, short)
    for name in obs.unreachable:
        if name in st.caps:
            caps[name] = st.caps[name]
    floor = max(plan_cap if coming > 0 else 0, relief_cap)
    sizing = {n: max(c, floor) for n, c in caps.items()}
    return BatchCaps(caps, sizing, coming, plan_cap, relief_cap)


# ------------------------------------------------------------------ phase 1b: capacity estimate


def pod_token_rate(p: PodObservation, prefill_pool: bool = False) -> float | None:
    """Rule 14 for one pod over its interval: the tokens per second it computes with a full step,
    ``(prompt_tokens / admitted) / (mean TTFT - mean queue time) + generation_tokens / interval_s``.

    Why: a step computes at most its token budget B; while a request's prompt is prefilled, each
    step carries a chunk of it plus one decode token per running request (R of them), so with step
    time t the prompt advances at (B - R) / t tokens/s and the decodes at R / t, which is the
    generated tokens per second: their sum is B / t, the replica's throughput at a full step,
    whatever the load. The mean prompt over the mean prefill time (TTFT less the queue time, from
    the two histograms) is the first term. A pod that idles between steps, or whose prompts are
    shorter than a chunk, measures less than its full-step throughput (the estimate errs low).
    In a disaggregated service's prefill pool (``prefill_pool``, rule 18) a request finishes with
    its first token, so the prompt-length histogram counts exactly the prompts whose prefill the
    TTFT histogram timed, and their mean is the mean prompt (when it has any): ``prompt_tokens /
    admitted`` divides the prompts started over the interval by every request that arrived, which
    a backlog makes far too low (a cold prefill pod holding 17 waiting: 26,759 tokens started over
    18 arrivals, 1,487 per prompt, where the 5 prompts it prefilled averaged 5,178; its estimate
    then started at 1,385 tokens/s instead of 4,821, and rule 5's token bound, 3 s of it,
    refused prompts it would have prefilled in time).
    None when the interval measured no prefill (no admission, no first token, no queue
    histogram, no prompt counter, or TTFT not above the queue time)."""
    if p.interval_s <= 0 or p.admitted <= 0 or p.prompt_tokens is None or p.ttft is None or p.queue is None:
        return None
    ttft, queue = p.ttft.mean, p.queue.mean
    if ttft is None or queue is None or ttft - queue <= 0:
        return None
    prompt = p.prompt_tokens / p.admitted
    if prefill_pool and p.prompt_len is not None and p.prompt_len.count > 0:
        prompt = p.prompt_len.sum / p.prompt_len.count
    return prompt / (ttft - queue) + p.generation_tokens / p.interval_s


@dataclass(frozen=True)
class Capacity:
    """Rule 14: what one replica computes, from what the replicas measure about themselves.

    sample: this call's estimate (tokens/s at a full step: the mean of :func:`pod_token_rate`
    over the ready pods that measured one; None = none did). tokens, var, seen_s: the smoothed
    estimate (tokens/s), the smoothed variance of the per-call estimate ((tokens/s)^2) and the
    seconds of calls behind it: the state to keep. scale: ``PolicyState.cap_scale``. sd: the
    standard deviation of the smoothed estimate (tokens/s). ready: it rests on at least one
    model-load time of calls. margin: ``min(0.9, capacity_margin_sd * sd / tokens)``. usable: the
    work per replica (offered tokens/s) a scale-down may plan for, ``token_utilization * tokens *
    scale * (1 - margin)`` (0 when not ready). p_max: the longest prompt (tokens) one idle replica
    prefills within the TTFT SLO, ``slo_ttft_s * tokens * (1 + margin)`` (None when not ready)."""

    sample: float | None
    tokens: float
    var: float
    seen_s: float
    scale: float
    sd: float
    ready: bool
    margin: float
    usable: float
    p_max: float | None


def capacity(obs: Observation, dt: float, horizon_s: float, spec: PolicySpec, st: PolicyState) -> Capacity:
    """Phase 1b: the capacity estimate of one replica (rule 14).

    dt: seconds since the previous call with metrics (the smoothing is per 5 s, ``length_alpha``,
    like the request lengths: the capacity moves with the length mix, slowly). The per-call
    estimate is smoothed exponentially (weight g) with its variance (West's exponentially weighted
    variance: ``var' = (1 - g) (var + g d^2)``, d the deviation from the old mean); the smoothed
    mean's standard deviation is ``sqrt(var g5 / (2 - g5))`` (g5: the weight per 5 s call), that of
    an exponentially weighted mean of independent samples. A call with an unreachable pod or no
    measurement carries the state unchanged."""
    rates = [x for p in obs.ready if (x := pod_token_rate(p, spec.prefill_pool)) is not None]
    tokens, var, seen = st.cap_tokens, st.cap_var, st.cap_seen_s
    sample = None
    if rates and not obs.unreachable:
        sample = sum(rates) / len(rates)
        if tokens <= 0:
            tokens, var, seen = sample, 0.0, max(0.0, dt)
        else:
            g = 1 - (1 - spec.length_alpha) ** (max(0.0, dt) / 5.0)
            d = sample - tokens
            tokens, var, seen = tokens + g * d, (1 - g) * (var + g * d * d), seen + max(0.0, dt)
    g5 = spec.length_alpha
    sd = math.sqrt(max(0.0, var) * g5 / (2 - g5))
    ready = tokens > 0 and seen >= horizon_s * 0.99
    margin = min(0.9, spec.capacity_margin_sd * sd / tokens) if tokens > 0 else 0.9
    scale = min(1.0, max(0.0, st.cap_scale))
    usable = spec.token_utilization * tokens * scale * (1 - margin) if ready else 0.0
    p_max = spec.slo_ttft_s * tokens * (1 + margin) if ready else None
    return Capacity(sample, tokens, var, seen, scale, sd, ready, margin, usable, p_max)


def infeasible(p: PodObservation, p_max: float | None) -> float:
    """Rule 16 for one pod: requests of the interval whose prompt is longer than ``p_max``
    (tokens, :attr:`Capacity.p_max`): the prompt-length histogram's count above it
    (interpolated inside its bucket). 0 without an estimate or a histogram."""
    if p_max is None or p.prompt_len is None or p.interval_s <= 0:
        return 0.0
    frac = p.prompt_len.fraction_le(p_max)
    n = p.prompt_len.counts[-1] if p.prompt_len.counts[-1] > 0 else p.prompt_len.count
    return 0.0 if frac is None else max(0.0, n * (1.0 - frac))


# --------------------------------------------------------------------- phase 2: fleet aggregate


@dataclass(frozen=True)
class Fleet:
    """Rule 1 and 3: one observation, summed. Rates in req/s, counts in requests, times in s.

    rated: ready pods with a rate (interval_s > 0). offered_rps: pods' admitted + 429s + router
    refusals per second; admitted_rps likewise. finished, slo_met, rejected (pods' 429s + router
    refusals), preempted: counts over the interval. in_flight: running + waiting on the pods +
    held + queued at the router; waiting: on the pods. kv_hot: some pod above kv_target.
    attainment: :func:`attainment` (None without requests). service_s: mean time one request
    occupies a slot (None = none finished); sizing_service_s: the same with TPOT at most the
    plan's (rule 4). tpot_mean: mean TPOT (0 = none). capacity: mean concurrency per replica with
    the sizing caps; live_capacity: with the caps in force now. t_first: mean TTFT - mean queue
    time. prompt_mean, output_mean: tokens per request this interval (None = no evidence).
    held, queued: at the router. infeasible: requests of the interval no replica could serve
    within the TTFT SLO (rule 16); ``attainment`` leaves them out of its denominator.
    queue_ttft_s: the TTFT budget of rule 5 with SLO classes (rule 17; None: ``slo_ttft_s``).
    classes_now: the declared SLO classes that finished requests over the interval (rule 17).
    """

    rated: int
    offered_rps: float
    admitted_rps: float
    finished: float
    slo_met: float
    rejected: float
    preempted: float
    in_flight: int
    waiting: int
    kv_hot: bool
    attainment: float | None
    service_s: float | None
    sizing_service_s: float | None
    tpot_mean: float
    capacity: float
    live_capacity: float
    t_first: float
    prompt_mean: float | None
    output_mean: float | None
    held: int = 0
    queued: int = 0
    infeasible: float = 0.0
    room: float = 0.0
    queue_ttft_s: float | None = None
    classes_now: tuple[str, ...] = ()


def classes_present(obs: Observation, spec: PolicySpec) -> tuple[str, ...]:
    """Rule 17: the declared SLO classes (``default`` included) whose requests finished on the
    ready pods over the interval, in declaration order (() without classes or counters)."""
    if not spec.slo_classes:
        return ()
    done: dict[str, float] = {}
    for p in obs.ready:
        if p.interval_s > 0 and p.class_finished is not None:
            for c, n in p.class_finished.items():
                done[c] = done.get(c, 0.0) + n
    return tuple(c for c in spec.class_slos() if done.get(c, 0.0) > 0)


def queue_ttft(now: float, present: tuple[str, ...], spec: PolicySpec, st: PolicyState) -> float | None:
    """Rule 17: the TTFT (seconds) that bounds a FIFO waiting queue: the strictest TTFT among the
    SLO classes present, those in ``present`` (:func:`classes_present`) and those
    ``st.class_seen`` saw finish within the last ``stabilization_window_s``; None without classes
    or without any class seen (rule 5 then uses ``slo_ttft_s``). A queue is first-in first-out
    whatever the class: a request queued behind k others waits k / mu whatever its own TTFT, so
    the queue is as deep as its strictest request allows, not as the mix would average (measured:
    a 5 s budget on the two-class trace, whose interactive class has 0.5 s, gives 0.590
    attainment against 0.763). A service whose strict class sends nothing for a window queues for
    the looser ones."""
    if not spec.slo_classes:
        return None
    slos = spec.class_slos()
    seen = set(present) | {c for c, t in st.class_seen.items() if now - t <= spec.stabilization_window_s}
    ttfts = [slos[c][0] for c in seen if c in slos]
    return min(ttfts) if ttfts else None


def aggregate(now: float, obs: Observation, caps: BatchCaps, spec: PolicySpec, st: PolicyState,
              p_max: float | None = None) -> Fleet:
    """Phase 2: the fleet's demand, attainment, service time and per-replica capacity.
    ``p_max``: the longest feasible prompt (:attr:`Capacity.p_max`); requests above it are
    infeasible (rule 16) and left out of the attainment: ``slo_met / max(slo_met, finished +
    rejected - infeasible)``."""
    rated = [p for p in obs.ready if p.interval_s > 0]
    router = obs.router
    router_dt = (now - st.last_tick) if st.last_tick is not None and now > st.last_tick else \
        _mean([p.interval_s for p in rated], 0.0)
    refused = router.refused if router is not None else 0.0
    refused_rps = refused / router_dt if router_dt > 0 else 0.0
    offered_rps = sum((p.admitted + p.rejected_429) / p.interval_s for p in rated) + refused_rps
    admitted_rps = sum(p.admitted / p.interval_s for p in rated)
    finished = sum(p.finished for p in rated)
    slo_met = sum(p.slo_met for p in rated)
    rejected = sum(p.rejected_429 for p in rated) + refused
    tpot_ceiling = st.plan_tpot_s if caps.coming > 0 and st.plan_tpot_s > 0 else math.inf
    services = [(s, p) for p in rated if (s := _pod_service_s(p, spec.slo_ttft_s)) is not None]
    weight = sum(p.finished for _, p in services)
    service_s = sum(s * p.finished for s, p in services) / weight if services else None
    sizing_service_s = (sum((_pod_service_s(p, spec.slo_ttft_s, tpot_ceiling) or s) * p.finished
                            for s, p in services) / weight) if services else None
    tpots = [p.tpot for p in rated if p.tpot is not None and p.tpot.count > 0]
    tpot_n = sum(h.count for h in tpots)
    ttfts = [p.ttft for p in rated if p.ttft is not None and p.ttft.count > 0]
    queues = [p.queue for p in rated if p.queue is not None and p.queue.count > 0]
    t_first = 0.0
    if ttfts and queues:   # time after the queue until the first token (prefill)
        t_first = max(0.0, sum(h.sum for h in ttfts) / sum(h.count for h in ttfts)
                      - sum(h.sum for h in queues) / sum(h.count for h in queues))
    fallback = float(_median(list(caps.sizing.values())) or spec.max_num_seqs)
    capacity = _mean([replica_capacity(p, caps.sizing[p.name], spec) for p in obs.ready], fallback)
    live = _mean([replica_capacity(p, caps.caps[p.name], spec) for p in obs.ready], capacity)
    room = _mean([replica_capacity(p, growth_room(p, caps.sizing[p.name], spec), spec) for p in obs.ready],
                 capacity)
    admitted = sum(p.admitted for p in rated)
    prompts = [p.prompt_tokens for p in rated if p.prompt_tokens is not None]
    prompt_mean = sum(prompts) / admitted if prompts and admitted > 0 else None
    output_mean = sum(p.generation_tokens for p in rated) / finished if finished > 0 else None
    held, queued = (router.held, router.queued) if router is not None else (0, 0)
    n_inf = sum(infeasible(p, p_max) for p in rated)
    present = classes_present(obs, spec)
    return Fleet(
        rated=len(rated), offered_rps=offered_rps, admitted_rps=admitted_rps, finished=finished,
        slo_met=slo_met, rejected=rejected, preempted=sum(p.preempted for p in rated),
        in_flight=sum(p.running + p.waiting for p in obs.ready) + held + queued,
        waiting=sum(p.waiting for p in obs.ready),
        kv_hot=any(p.kv_usage > spec.kv_target for p in obs.ready),
        attainment=attainment(slo_met, max(slo_met - rejected, finished - n_inf), rejected),
        service_s=service_s,
        sizing_service_s=sizing_service_s,
        tpot_mean=sum(h.sum for h in tpots) / tpot_n if tpot_n > 0 else 0.0,
        capacity=capacity, live_capacity=live, t_first=t_first, prompt_mean=prompt_mean,
        output_mean=output_mean, held=held, queued=queued, infeasible=n_inf, room=room,
        queue_ttft_s=queue_ttft(now, present, spec, st), classes_now=present)


# ------------------------------------------------------------------------------- phase 3: size


@dataclass(frozen=True)
class Size:
    """Rule 3 and 4. sizing_rps: the offered rate sized for (retried 429s while capacity loads
    are not new demand); service_s: the service time sized with; demand: L in sequences;
    per_replica: sequences one replica carries at target utilization; wanted: replicas for L
    (and for the attainment evidence); saturated, evidence: the fleet is saturated / missing its
    SLO while saturated with nothing coming; up_reason: the reason a scale-up would carry;
    rec: wanted within [max(1, min_replicas), max_replicas]."""

    sizing_rps: float
    service_s: float
    demand: float
    per_replica: float
    wanted: int
    saturated: bool
    evidence: bool
    up_reason: str
    rec: int


def size(fleet: Fleet, caps: BatchCaps, n_ready: int, spec: PolicySpec, st: PolicyState) -> Size:
    """Phase 3: replicas wanted now from Little's law and the attainment evidence (rules 3, 4)."""
    service_s = fleet.sizing_service_s if fleet.sizing_service_s is not None else st.service_s
    sizing_rps = fleet.offered_rps
    if caps.coming > 0:      # retried 429s while capacity loads are not new demand (rule 4)
        plan = st.plan_offered_rps or fleet.offered_rps
        sizing_rps = min(fleet.offered_rps, max(plan, fleet.admitted_rps))
    # refusals say the fleet is full when they are more than stray ones: under rule 5's token bound
    # a long prompt behind another on one replica is refused while the others have room
    refusing = fleet.rejected > spec.tolerance * (fleet.finished + fleet.rejected)
    saturated = (fleet.waiting > spec.queue_target * max(1, n_ready) or refusing
                 or fleet.preempted > 0 or fleet.kv_hot or fleet.queued > 0)
    missing = fleet.attainment is not None and \
        fleet.attainment < spec.attainment_target * (1 - spec.tolerance / 2)
    # a calm fleet (not saturated, SLO held, nothing loading) is sized with the batch rule 2 would
    # grow to the moment it binds (growth_room): the learned batch is a floor, not a ceiling
    calm = not saturated and caps.coming == 0 and (fleet.attainment is None or fleet.attainment
                                                   >= spec.attainment_target)
    per_replica = max(1e-9, max(fleet.capacity, fleet.room if calm else 0.0) * spec.target_utilization)
    demand = max(float(fleet.in_flight), sizing_rps * service_s)
    wanted = math.ceil(demand / per_replica - 1e-9) if demand > 0 else 0
    # misses while pods load are expected (rule 4): only a fleet with nothing coming is evidence
    evidence = missing and saturated and caps.coming == 0
    if evidence:
        # goodput-proportional (HPA's formula on attainment): at least one more
        att = max(fleet.attainment or 0.0, 0.25)
        wanted = max(wanted, n_ready + 1, math.ceil(n_ready * spec.attainment_target / att - 1e-9))
    up_reason = "ScaleUpSaturation" if (fleet.preempted > 0 or fleet.kv_hot) else "ScaleUpGoodput"
    rec = max(max(1, spec.min_replicas), min(spec.max_replicas, wanted))
    return Size(sizing_rps, service_s, demand, per_replica, wanted, saturated, evidence, up_reason, rec)


def prefill_size(obs: Observation, fleet: Fleet, sz: Size, cap: Capacity, level_rps: float,
                 spec: PolicySpec, st: PolicyState) -> Size:
    """Rule 18, the prefill pool of a disaggregated service (``spec.prefill_pool``): its pods
    report no TPOT, so rule 3 has no service time and only the attainment evidence (rule 4), which
    lags a backlog, would move it. A prefill pod computes the prompts it holds one after another
    at its full-step speed, so one request occupies it ``service_s`` seconds, the shorter of the
    interval's prefill time (``Fleet.t_first``: mean TTFT less mean queue time; noisy) and the
    mean prompt over rule 14's estimate (``cap.tokens * cap.scale`` tokens/s from its first
    sample on; smoothed; a prefill pod's own prompts over its prefill time, :func:`pod_token_rate`;
    prompt: the mean of the interval's prompt-length histograms, else the smoothed prompt level),
    and one replica carries one request at a time:
    ``per_replica = token_utilization``, ``demand = level_rps * service_s`` (replicas busy at
    rule 11's smoothed offered rate: the offered prompt tokens over one replica's tokens/s, a
    leading signal; on a cold pool its first value is :func:`backlog_rate`'s),
    ``wanted = ceil(demand / token_utilization)``. The attainment evidence then
    adds one replica at a time (the size is known; HPA's proportional step overshoots on a
    backlog), and not while a ready pod is younger than the interval plus ``queue_slack`` TTFT
    SLOs: misses of requests that queued before ordered capacity arrived are no new evidence.
    Without a service time: ``sz`` unchanged (rules 3 and 4). E.g. 3 req/s of 4000-token prompts
    on replicas of 4000 tokens/s: service 1 s, demand 3 replicas busy, wanted ceil(3 / 0.8) = 4."""
    tokens = cap.tokens * cap.scale
    hists = [p.prompt_len for p in obs.ready if p.interval_s > 0 and p.prompt_len is not None
             and p.prompt_len.count > 0]
    n = sum(h.count for h in hists)
    prompt = sum(h.sum for h in hists) / n if n > 0 else st.prompt_level
    services = [x for x in (fleet.t_first, prompt / tokens if tokens > 0 and prompt > 0 else 0.0) if x > 0]
    if not services:
        return sz
    service_s = min(services)
    per_replica = spec.token_utilization
    demand = level_rps * service_s
    wanted = math.ceil(demand / per_replica - 1e-9) if demand > 0 else 0
    settling = any(p.age_s < p.interval_s + spec.queue_slack * spec.slo_ttft_s for p in obs.ready)
    evidence = sz.evidence and not settling
    if evidence:
        wanted = max(wanted, len(obs.ready) + 1)
    rec = max(max(1, spec.min_replicas), min(spec.max_replicas, wanted))
    return Size(sz.sizing_rps, service_s, demand, per_replica, wanted, sz.saturated, evidence, sz.up_reason, rec)


def backlog_rate(obs: Observation, fleet: Fleet, coming: int, st: PolicyState) -> float | None:
    """Rule 18, the first rate of a cold prefill pool: the offered req/s over its pods' whole life,
    read from the queue they hold, or None (then the interval's offered rate, as everywhere).

    Rule 11's level starts at the first interval's offered rate, a Poisson count over one interval
    (at 3 req/s over 5 s, +-26 %), and the first order is made on it. A pod's counters start at
    zero when it becomes ready and its first scrape gives no delta, so what arrived before the
    interval is not counted; a prefill pod that queues and refuses nothing still holds it. Over its
    age A, arrivals = what it holds (running + waiting) + what it served, and a pod queueing since
    it became ready served at the rate it served over the interval (its first tokens: the TTFT
    histogram's count): ``(running + waiting) / A + ttft.count / interval_s``, a count over A
    instead of the interval. Only when every ready pod became ready at most one interval before
    the interval began (``interval_s < age_s <= 2 interval_s``: the part of its life before the
    interval is no longer than the interval, so it is the unseen first scrape's, not hours of an
    older pod's), holds requests waiting, and the pool refused nothing (the pods' 429s and the
    router's: those left the queue), on the first call with rates (Holt's level unset) with nothing
    coming (rule 4 sizes the rate then). E.g. a pod ready 10 s ago, its interval 5 s, 18 requests
    in flight and 5 prefills done: 18 / 10 + 5 / 5 = 2.8 req/s, where the interval counted 18
    arrivals (3.6 req/s)."""
    if st.level_rps is not None or coming > 0 or fleet.rejected > 0 or not obs.ready or obs.unreachable:
        return None
    rate = 0.0
    for p in obs.ready:
        young = p.interval_s < p.age_s <= 2 * p.interval_s
        if p.interval_s <= 0 or p.ttft is None or p.waiting <= 0 or not young:
            return None
        rate += (p.running + p.waiting) / p.age_s + p.ttft.count / p.interval_s
    return rate


# --------------------------------------------------------------------------- phase 4: forecast


@dataclass(frozen=True)
class Forecast:
    """Rule 11. level_rps, trend_rps: Holt's state after this observation (req/s, req/s per s);
    prompt_level, output_level: smoothed tokens per request; horizon_s: the model-load time used;
    rps: the offered load forecast at the horizon (req/s); work: the offered work per second
    (tokens, prompt + output) at the smoothed level (a rise ahead reaches the scale-down through
    Little's law at ``rps``, not through the work, whose trend is too noisy to compare with the
    proven work); rec: replicas for the forecast load
    (Little's law, bounded like ``Size.rec``); load_s: the smoothed model-load time to keep;
    work_fc: the offered work per second at the larger of the level and the forecast (tokens/s:
    what the survivors of a scale-down carry, rule 14)."""

    level_rps: float
    trend_rps: float
    prompt_level: float
    output_level: float
    horizon_s: float
    rps: float
    work: float
    rec: int
    load_s: float
    work_fc: float = 0.0


def forecast(now: float, obs: Observation, fleet: Fleet, caps: BatchCaps, sz: Size, metrics_ok: bool,
             spec: PolicySpec, st: PolicyState) -> Forecast:
    """Phase 4: Holt's linear trend on the offered load over one model-load time (rule 11).

    The input is the rate sized for (``Size.sizing_rps``: offered, less retried 429s while
    capacity loads). Without metrics the state is carried unchanged (an outage is not zero
    traffic); exactly zero traffic is a level falling to 0, never NaN. While capacity is coming
    the forecast recommends nothing (``rec`` = the lower bound): the coming pods were ordered for
    this horizon, and a step of load extrapolated as a trend would pile up pods (rule 4).
    """
    new_loads = [p.load_s for p in obs.ready if p.load_s is not None and p.load_s > 0
                 and p.name not in st.caps]
    load_s = st.load_s
    for x in new_loads:      # a pod seen ready for the first time: its load time
        load_s = x if load_s <= 0 else 0.5 * load_s + 0.5 * x
    horizon = load_s if load_s > 0 else spec.model_load_s
    level, trend = st.level_rps, st.trend_rps
    prompt_l, output_l = st.prompt_level, st.output_level
    if metrics_ok and fleet.rated > 0:
        x = sz.sizing_rps    # retried 429s while capacity loads are not new demand (rule 4)
        dt = now - st.last_tick if st.last_tick is not None and now > st.last_tick else 0.0
        if level is None:
            level, trend = x, 0.0
        else:       # smoothing factors are per 5 s: a longer gap forgets more
            a = 1 - (1 - spec.forecast_alpha) ** (dt / 5.0)
            b = 1 - (1 - spec.forecast_beta) ** (dt / 5.0)
            prev = level
            level = max(0.0, a * x + (1 - a) * (level + trend * dt))
            trend = b * (level - prev) / dt + (1 - b) * trend if dt > 0 else trend
        g = 1 - (1 - spec.length_alpha) ** (dt / 5.0)
        if fleet.prompt_mean is not None:
            prompt_l = fleet.prompt_mean if prompt_l <= 0 else g * fleet.prompt_mean + (1 - g) * prompt_l
        if fleet.output_mean is not None:
            output_l = fleet.output_mean if output_l <= 0 else g * fleet.output_mean + (1 - g) * output_l
    base = level if level is not None else fleet.offered_rps
    rps = min(max(0.0, base + trend * horizon), spec.panic_ratio * base)
    work = base * (prompt_l + output_l)
    want = math.ceil(rps * sz.service_s / sz.per_replica - 1e-9) if rps > 0 and sz.service_s > 0 else 0
    if caps.coming > 0:
        want = 0    # the capacity coming was ordered for this horizon already (rule 4)
    rec = max(max(1, spec.min_replicas), min(spec.max_replicas, want))
    return Forecast(level if level is not None else 0.0, trend, prompt_l, output_l, horizon, rps, work,
                    rec, load_s, max(base, rps) * (prompt_l + output_l))


# --------------------------------------------------------------------------- phase 4b: headroom

SPIKE_NOISE_SD = 2.5
"""Rule 15: a horizon's mean work counts as a spike only above this many standard deviations of
its own arrival noise (a compound Poisson sum whose per-request work has a coefficient of
variation of 1: relative sd ``sqrt(2 / requests)``): on a steady load the largest of the ~15
horizons of a 15-minute window reaches about +2 sd by chance, which must not order capacity."""


SHORT_SPIKE = 0.5
"""Rule 15: a spike no longer than one model-load horizon H raises the peak-to-mean ratio over two
horizons above 1 by this fraction of its excess over one horizon: a spike of height A above the
mean lasting d <= H raises the one-horizon peak by A d / H and the two-horizon peak by A d / 2H
(fraction 1/2); for H <= d <= 2H the fraction is d / 2H, for d >= 2H it is 1. The window's spikes
are *short* (:func:`short_spikes`) up to d = H + P (P: the call interval; capacity ordered on the
first call that sees a spike is ready up to H + P after it began), a fraction of
``SHORT_SPIKE + P / 2H``."""


@dataclass(frozen=True)
class Headroom:
    """Rule 15. ratio: the short-term peak-to-mean ratio of the offered work (>= 1); mean_work,
    mean_rps: the window's mean offered work (tokens/s) and requests (req/s); work, rps: what the
    spike needs, ``ratio`` times the means; history: the work history to keep, ``(time, seconds,
    tokens, requests)`` per call; covered: the history spans at least one horizon (before that
    ``work`` and ``rps`` rest on too little to replace the forecast); recent_work: the mean
    offered work over the last horizon (tokens/s); short: the history before the last horizon
    spans two horizons and holds a spike, and its spikes are short (:func:`short_spikes`: its
    peak-to-mean ratio over two horizons exceeds 1 by at most ``SHORT_SPIKE + P / 2H`` of the
    excess over one horizon, P the call interval); False when the headroom is off."""

    ratio: float
    mean_work: float
    mean_rps: float
    history: tuple[tuple[float, float, float, float], ...]
    covered: bool = False
    recent_work: float = 0.0
    short: bool = False

    @property
    def work(self) -> float:
        return self.ratio * self.mean_work

    @property
    def rps(self) -> float:
        return self.ratio * self.mean_rps


def peak_to_mean(history: typing.Sequence[typing.Sequence[float]], horizon_s: float,
                 noise_sd: float = SPIKE_NOISE_SD) -> tuple[float, float, float]:
    """Rule 15: ``(ratio, mean work, mean requests)`` of a work history ``[(time, seconds,
    tokens, requests)]`` (time ascending: the end of each call's interval).

    For every run of consecutive calls covering one horizon (the model-load time; runs shorter
    than 0.99 of it are skipped), its mean work ``m`` (tokens/s) less ``noise_sd`` times its
    arrival noise ``m * sqrt(2 / requests)``, over the whole history's mean work; ratio = the
    largest of these, at least 1 (1 without a whole horizon or without work)."""
    total_s = sum(e[1] for e in history)
    total_w = sum(e[2] for e in history)
    if total_s <= 0 or total_w <= 0 or horizon_s <= 0:
        return 1.0, (total_w / total_s if total_s > 0 else 0.0), \
            (sum(e[3] for e in history) / total_s if total_s > 0 else 0.0)
    mean_w, mean_n = total_w / total_s, sum(e[3] for e in history) / total_s
    best, j, secs, work, reqs = 1.0, 0, 0.0, 0.0, 0.0
    for t, dt, w, n in history:
        secs, work, reqs = secs + dt, work + w, reqs + n
        while secs - history[j][1] >= horizon_s * 0.99:     # drop calls older than one horizon
            secs, work, reqs = secs - history[j][1], work - history[j][2], reqs - history[j][3]
            j += 1
        if secs >= horizon_s * 0.99 and reqs > 0:
            m = work / secs
            best = max(best, (m - noise_sd * m * math.sqrt(2.0 / reqs)) / mean_w)
    return best, mean_w, mean_n


def short_spikes(history: typing.Sequence[typing.Sequence[float]], horizon_s: float) -> bool:
    """Rule 15: does a work history (as :func:`peak_to_mean` reads it) span two horizons and hold a
    spike (peak-to-mean ratio r1 over one horizon above 1) that ended before capacity ordered for
    it could be ready, a length of at most one horizon plus one call interval P (seconds: the
    median of the history's intervals): ``r2 - 1 <= min(1, SHORT_SPIKE + P / (2 horizon_s)) *
    (r1 - 1)`` with r2 the ratio over two horizons? (horizon_s: the model-load time, seconds.)"""
    if sum(e[1] for e in history) < 2 * horizon_s * 0.99:
        return False
    r1 = peak_to_mean(history, horizon_s)[0]
    r2 = peak_to_mean(history, 2 * horizon_s)[0]
    period = statistics.median(e[1] for e in history)
    frac = min(1.0, SHORT_SPIKE + period / (2 * horizon_s))
    return r1 > 1 and r2 - 1 <= frac * (r1 - 1) + 1e-12


def last_horizon(history: typing.Sequence[typing.Sequence[float]], horizon_s: float) -> tuple[int, float, float]:
    """Rule 15: ``(calls, seconds, tokens)`` of the newest calls of a work history (as
    :func:`peak_to_mean` reads it) that first span 0.99 of ``horizon_s`` (all of it when shorter)."""
    secs = work = 0.0
    n = 0
    for e in reversed(history):
        if secs >= horizon_s * 0.99:
            break
        secs, work, n = secs + e[1], work + e[2], n + 1
    return n, secs, work


def spikes_were_short(st: PolicyState, spec: PolicySpec) -> bool:
    """Rule 2 and 15: did the previous call's spike headroom see short spikes (:attr:`Headroom.short`)?
    From the work history in the state: :func:`short_spikes` of its calls before the last horizon
    (``st.load_s``, ``model_load_s`` until one is measured); False with the headroom off."""
    if spec.headroom_window_s <= 0:
        return False
    horizon = st.load_s if st.load_s > 0 else spec.model_load_s
    hist = st.work_history
    n = last_horizon(hist, horizon)[0]
    return short_spikes(hist[:len(hist) - n], horizon)


def headroom(now: float, dt: float, fleet: Fleet, fc: Forecast, metrics_ok: bool, spec: PolicySpec,
             st: PolicyState) -> Headroom:
    """Phase 4b: the offered work's recent history and the spike headroom (rule 15). Each call
    with metrics adds its offered work (offered req/s x (this interval's mean prompt, else the
    smoothed one, + the smoothed output) x dt) to a history of ``max(headroom_window_s,
    stabilization_window_s)``; :func:`peak_to_mean` over one model-load horizon sizes what a
    spike shorter than a model load needs (ratio 1 when ``headroom_window_s`` is 0: the history
    then only gives the means a scale-down is judged on, rule 14)."""
    keep_s = max(spec.headroom_window_s, spec.stabilization_window_s)
    hist = [(e[0], e[1], e[2], e[3]) for e in st.work_history if now - e[0] < keep_s]
    if metrics_ok and fleet.rated > 0 and dt > 0:
        prompt = fleet.prompt_mean if fleet.prompt_mean is not None else fc.prompt_level
        hist.append((now, dt, fleet.offered_rps * dt * (prompt + fc.output_level), fleet.offered_rps * dt))
    ratio, mean_w, mean_n = peak_to_mean(hist, fc.horizon_s)
    n, secs, work = last_horizon(hist, fc.horizon_s)
    return Headroom(ratio if spec.headroom_window_s > 0 else 1.0, mean_w, mean_n, tuple(hist),
                    sum(e[1] for e in hist) >= fc.horizon_s * 0.99, work / secs if secs > 0 else 0.0,
                    spec.headroom_window_s > 0 and short_spikes(hist[:len(hist) - n], fc.horizon_s))


# ---------------------------------------------------------------------------- phase 5: windows


@dataclass(frozen=True)
class Windows:
    """Rules 7, 8, 10. recommendations: the window history to keep, ``(time, replicas, keep)``;
    up_target: the scale-up target (window minimum unless panic, evidence or missing metrics);
    down_target: the window maximum of both the recommendations and the fewest replicas that
    carry the load (``keep``, rule 7); history_s: seconds of history with metrics; since: when
    that history started."""

    recommendations: tuple[tuple[float, float, float], ...]
    up_target: int
    down_target: int
    history_s: float
    since: float | None


def windows(now: float, current: int, sz: Size, fc: Forecast, keep: int, metrics_ok: bool,
            spec: PolicySpec, st: PolicyState) -> Windows:
    """Phase 5: the scale-up and stabilization windows over this call's recommendation (the
    larger of now's and the forecast's) and ``keep`` (:func:`fewest_carrying`)."""
    rec = max(sz.rec, fc.rec)
    if not metrics_ok:      # silent pods are assumed busy (rule 10)
        rec_w, keep = max(rec, current), max(keep, current)
    else:
        rec_w = rec
    since = st.since if st.since is not None or not metrics_ok else now
    horizon = max(spec.stabilization_window_s, spec.scale_up_window_s)
    entries = [(e[0], e[1], e[2] if len(e) > 2 else e[1]) for e in st.recommendations]
    recs = [e for e in entries + [(now, float(rec_w), float(keep))] if now - e[0] <= horizon]
    up = [r for t, r, _ in recs if now - t <= spec.scale_up_window_s] or [rec]
    down = [max(r, k) for t, r, k in recs if now - t <= spec.stabilization_window_s] or [rec]
    up_target = int(min(up))
    if sz.rec >= max(spec.panic_ratio * max(1, current), current + 2) or sz.evidence or not metrics_ok:
        # panic (on load seen, never on a forecast), SLOs missed while saturated, or only the
        # pods that answered speak
        up_target = max(sz.rec, up_target) if metrics_ok else rec
    return Windows(tuple(recs), up_target, int(max(down)),
                   now - since if since is not None else 0.0, since)


# --------------------------------------------------------------------------- phase 6: replicas


@dataclass(frozen=True)
class Proof:
    """Rule 7. proven: the most offered work per replica (tokens/s) sustained while the SLO held;
    samples: ``(time, work per replica)`` of the current run of good calls within one model-load
    time (cleared by a call that is not good)."""

    proven: float
    samples: tuple[tuple[float, float], ...]


def proven_work(now: float, fleet: Fleet, caps: BatchCaps, sz: Size, fc: Forecast, n_ready: int,
                metrics_ok: bool, spec: PolicySpec, st: PolicyState) -> Proof:
    """Rule 7: what the fleet has proven it serves. A call is *good* when metrics are complete,
    nothing loads, the fleet is not saturated and attainment is at target (or there were no
    requests). A work per replica counts as proven once good calls have lasted a whole model-load
    time with at least that work in each (the minimum of the run's samples): a single noisy
    interval or a spike proves nothing."""
    good = (metrics_ok and caps.coming == 0 and not sz.saturated and fleet.rated > 0 and n_ready > 0
            and (fleet.attainment is None or fleet.attainment >= spec.attainment_target))
    if not good:
        return Proof(st.proven_work, ())
    run = [(t, w) for t, w in map(tuple, st.proof)]
    # keep the newest sample at least one horizon old (it anchors the span) and all newer ones
    old = [i for i, (t, _) in enumerate(run) if now - t >= fc.horizon_s * 0.99]
    samples = run[old[-1]:] if old else run
    samples.append((now, fc.work / n_ready))
    proven = st.proven_work
    if now - samples[0][0] >= fc.horizon_s * 0.99:   # good for a whole load time
        proven = max(proven, min(w for _, w in samples))
    return Proof(proven, tuple(samples))


def carries(m: int, proven: float, fleet: Fleet, sz: Size, fc: Forecast, spec: PolicySpec,
            st: PolicyState, cap: Capacity | None = None, head: Headroom | None = None) -> bool:
    """Rules 7, 14, 15: would ``m`` replicas carry the load with margin? Little's law now, at the
    forecast and at the spike headroom (``head``); the work per replica below the work that
    already failed; and then either a nearly idle fleet, or (survivor load, rule 14, once the
    capacity estimate is ready) the work each of the ``m`` would carry within the estimate's usable
    work per replica or within what the fleet has proven, or (no estimate yet) the work per
    replica within ``explore_ratio`` of ``proven``. (With an estimate, rule 7's step past the proof
    is not taken: 3 -> 2 replicas at 12 req/s on the steady trace is within 1.75x of what 3 proved
    and 1.3x over what 2 carry.) The survivors' work is the mean over the last horizon
    (``head.recent_work``), or with a spike in the window (``head.ratio`` > 1) the larger of that
    and the spike headroom's (``head.work``: the window's mean offered work times its peak-to-mean
    ratio), once the history spans a horizon, else the work at the forecast (``fc.work_fc``). (The
    window's mean alone would keep a past burst's capacity for a whole window: azure-code spent
    7.41 replica-hours with it against 6.0 with the last horizon's mean.) a rise ahead reaches the check through Little's law at the forecast (the
    first check). Why not the smoothed level or its forecast: the stabilization window keeps the
    largest ``keep`` of 300 s, and the largest of 60 noisy levels (and trends) is ~25 % above the
    load (Poisson at 3.5 req/s), which queueing inside one replica absorbs and the utilization
    target already allows for."""
    if m <= 0:
        return False
    spike = head is not None and head.covered and head.ratio > 1
    demand_fc = max(sz.demand, fc.rps * sz.service_s, head.rps * sz.service_s if spike else 0.0)
    if demand_fc > m * sz.per_replica:
        return False
    work = fc.work / m
    survivor = ((max(head.work, head.recent_work) if spike else head.recent_work)
                if head is not None and head.covered else fc.work_fc) / m
    if st.floor > m and st.fail_work > 0 and max(work, survivor) >= st.fail_work * spec.floor_release:
        return False
    if spike and cap is not None and cap.ready and head.work / m > max(cap.usable, proven) + 1e-9:
        return False        # a lull between spikes is not idle: the spike's work must fit (rule 15)
    idle = demand_fc <= spec.idle_utilization * m * sz.per_replica
    if idle:
        return True
    if cap is not None and cap.ready:     # the estimate replaces rule 7's bounded step past the proof
        return survivor <= max(cap.usable, proven) + 1e-9
    return work <= spec.explore_ratio * proven + 1e-9


def fewest_carrying(current: int, proven: float, fleet: Fleet, sz: Size, fc: Forecast, spec: PolicySpec,
                    st: PolicyState, cap: Capacity | None = None, head: Headroom | None = None) -> int:
    """Rule 7: the fewest replicas (at most ``current``, at least ``max(1, min_replicas)``) that
    :func:`carries` the load now; the stabilization window keeps its maximum, so a lull shorter
    than the window never lets the fleet shrink below what the rest of the window needed."""
    lo = max(1, spec.min_replicas)
    for m in range(lo, max(lo, current)):
        if carries(m, proven, fleet, sz, fc, spec, st, cap, head):
            return m
    return max(lo, current)


def short_spike_limit(current: int, head: Headroom | None, cap: Capacity | None) -> int | None:
    """Rule 15: the most replicas a scale-up may order during a short spike, or None (no limit).

    While the spikes the window saw before the last horizon ended before capacity ordered for them
    could be ready (:attr:`Headroom.short`: no longer than one model load plus one call interval),
    capacity ordered now is ready after the spike under way has ended:
    it can only serve a later spike, and what a later spike needs is the window's spike work (the
    headroom's, :attr:`Headroom.work`, which counts the spike under way) at the measured
    full-step capacity, ``ceil(head.work / (cap.tokens * cap.scale))``. The limit is the larger
    of that and ``current`` (it never scales down). None without a ready estimate or without
    short spikes before: the first spike, or a load whose rises outlast a model load, is left to
    the scale-up rules."""
    if head is None or cap is None or not cap.ready or not head.short:
        return None
    full = cap.tokens * cap.scale
    if full <= 0:
        return None
    return max(current, math.ceil(head.work / full - 1e-9))


@dataclass(frozen=True)
class Replicas:
    """Phase 6's outcome: the replicas to set and why."""

    replicas: int
    reason: str


def choose_replicas(now: float, obs: Observation, fleet: Fleet, caps: BatchCaps, sz: Size, fc: Forecast,
                    win: Windows, proven: float, metrics_ok: bool, spec: PolicySpec,
                    st: PolicyState, cap: Capacity | None = None, head: Headroom | None = None) -> Replicas:
    """Phase 6: the replicas (rules 7-10, 12), from the targets of the windows."""
    current, n_ready = obs.current_replicas, len(obs.ready)
    held = obs.router.held if obs.router is not None else 0
    idle_since = st.last_busy if st.last_busy is not None else now
    if current == 0:
        if held > 0 or spec.min_replicas > 0:
            return Replicas(max(1, spec.min_replicas), "ScaleFromZero" if held > 0 else "ScaleUpMinReplicas")
        return Replicas(0, "Steady")
    if current < spec.min_replicas:
        return Replicas(spec.min_replicas, "ScaleUpMinReplicas")
    if current > spec.max_replicas:
        return Replicas(spec.max_replicas, "ScaleDownMaxReplicas")
    rec = max(sz.rec, fc.rec)
    in_band = abs(rec / current - 1.0) <= spec.tolerance + 1e-9
    limit = short_spike_limit(current, head, cap) if metrics_ok else None
    if limit is not None and win.up_target > limit and not in_band:
        if limit <= current:
            return Replicas(current, "HoldShortSpike")
        win = replace(win, up_target=limit)
    if win.up_target > current and not in_band:
        step = max(spec.max_scale_up_step, current)
        reason = sz.up_reason if sz.rec > current or sz.evidence else "ScaleUpForecast"
        return Replicas(min(win.up_target, current + step), reason)
    if rec > current and not in_band:
        return Replicas(current, "HoldStabilizing")   # the scale-up window has not confirmed it yet
    if spec.min_replicas == 0 and obs.router is not None and metrics_ok and _idle(fleet) \
            and now - idle_since >= spec.scale_to_zero_idle_s and caps.coming == 0:
        return Replicas(0, "ScaleToZeroIdle")
    if rec < current and not metrics_ok:
        return Replicas(current, "HoldMissingMetrics")
    if rec < current and caps.coming > 0:
        return Replicas(current, "HoldStarting")
    if rec < current and not in_band:
        target = max(win.down_target, current - spec.max_scale_down_step, 1, spec.min_replicas)
        holds = (fleet.rejected == 0 and fleet.preempted == 0
                 and (fleet.attainment is None or fleet.attainment >= spec.attainment_target))
        load_time = fc.horizon_s
        quiet = all(t is None or now - t >= load_time
                    for t in (st.last_up_time, st.last_down_time, st.last_loading_time))
        if target < current and holds and win.history_s >= spec.stabilization_window_s and quiet \
                and carries(target, proven, fleet, sz, fc, spec, st, cap, head):
            return Replicas(target, "ScaleDownIdle" if sz.demand == 0 else "ScaleDown")
        return Replicas(current, "HoldStabilizing")
    return Replicas(current, "HoldStarting" if caps.coming > 0 else "Steady")


def _idle(fleet: Fleet) -> bool:
    return fleet.offered_rps == 0 and fleet.in_flight == 0 and fleet.rejected == 0


# ----------------------------------------------------------------------- phase 7: queue limits


@dataclass(frozen=True)
class QueueLimits:
    """Rule 5 and 12. max_waiting: per ready pod; router_max_queued: the router's fleet queue
    (None without a service rate); k_ttft: queued requests one replica serves within TTFT;
    max_waiting_tokens: the prompt tokens one replica prefills within TTFT (0 = no bound)."""

    max_waiting: int
    router_max_queued: int | None
    k_ttft: int | None
    max_waiting_tokens: int = 0


def queue_limits(fleet: Fleet, n_ready: int, coming: int, added: int, spec: PolicySpec,
                 service_s: float, token_rate: float = 0.0) -> QueueLimits:
    """Phase 7: the waiting-queue limits from the TTFT budget (rule 5) and the router's bound.
    token_rate: the tokens one replica computes per second at a full step (rule 14's estimate,
    ready or not; 0 = nothing measured yet: no token bound)."""
    mu = fleet.live_capacity / service_s if service_s > 0 else 0.0   # completions/s per replica
    ttft = fleet.queue_ttft_s if fleet.queue_ttft_s is not None else spec.slo_ttft_s   # rule 17
    budget = max(0.0, ttft - fleet.t_first)
    k_ttft = math.floor(budget * mu) if mu > 0 else None
    loading = coming + max(0, added)
    ready_frac = n_ready / max(1, n_ready + loading) if loading else 1.0
    slack = 1.0 + (spec.queue_slack - 1.0) * ready_frac
    k = spec.max_waiting if k_ttft is None else math.floor(k_ttft * slack)
    max_waiting = max(spec.min_waiting, min(spec.max_waiting, k))
    router = math.floor(budget * mu * n_ready) if mu > 0 and n_ready > 0 else None
    bound = ttft * token_rate * spec.token_queue_scale
    tokens = max(1, math.floor(bound)) if bound > 0 else 0
    return QueueLimits(max_waiting, router, k_ttft, tokens)


# ------------------------------------------------------------------------- phase 8: conditions


def conditions(obs: Observation, fleet: Fleet, metrics_ok: bool, reason: str, message: str,
               spec: PolicySpec) -> dict[str, tuple[bool, str, str]]:
    """Phase 8: MetricsAvailable, ScalingActive, AbleToScale (HPA's conditions)."""
    if obs.unreachable:
        metrics_msg = f"{len(obs.unreachable)} ready pod(s) not scraped: {', '.join(obs.unreachable)}"
    elif not obs.ready:
        metrics_msg = "no ready pod to scrape"
    elif fleet.rated == 0:
        metrics_msg = "first scrape of every ready pod; rates need a second one"
    else:
        metrics_msg = f"{fleet.rated} ready pod(s) scraped"
    active = spec.min_replicas != spec.max_replicas
    holding = reason in ("HoldStarting", "HoldStabilizing", "HoldMissingMetrics", "HoldShortSpike",
                         "HoldPrefillStarting")
    return {
        "MetricsAvailable": (metrics_ok, "MetricsScraped" if metrics_ok else "MetricsMissing", metrics_msg),
        "ScalingActive": (active, "ValidMetricFound" if active else "ScalingDisabled",
                          f"replicas between {spec.min_replicas} and {spec.max_replicas}"),
        # the decision's reason once: as the condition's reason while holding, else before the message
        "AbleToScale": (not holding, reason if holding else "ReadyForNewScale",
                         message if holding else f"{reason}: {message}"),
    }


# -------------------------------------------------------------------------------------- state


def next_state(now: float, obs: Observation, fleet: Fleet, caps: BatchCaps, sz: Size, fc: Forecast,
               win: Windows, proof: Proof, out: Replicas, metrics_ok: bool, spec: PolicySpec,
               st: PolicyState, cap: Capacity | None = None, head: Headroom | None = None) -> PolicyState:
    """What the next call remembers: windows, caps, plan (rule 4), Holt (rule 11), the proven and
    failed work per replica and the floor (rule 7), the last busy time (rule 12), the capacity
    estimate and what an undone scale-down taught it (rule 14), the work history (rule 15), when
    each SLO class last finished a request (rule 17). An undone scale-down scales the capacity estimate so that its usable work falls below
    ``(1 - tolerance)`` times the work per replica that failed; the scale returns to 1 when the
    floor has decayed away."""
    current, replicas = obs.current_replicas, out.replicas
    n_ready = len(obs.ready)
    plan_cap, plan_tpot, plan_rps = caps.plan_cap, st.plan_tpot_s, st.plan_offered_rps
    if caps.coming > 0:
        plan_tpot = plan_tpot or fleet.tpot_mean
        plan_rps = plan_rps or fleet.offered_rps
    if replicas > current:      # what this scale-up was sized with (rule 4)
        plan_cap = _median(list(caps.sizing.values())) or plan_cap
        plan_tpot = min(fleet.tpot_mean, plan_tpot or math.inf) if fleet.tpot_mean else plan_tpot
        plan_rps = max(sz.sizing_rps, plan_rps if caps.coming else 0.0)
    elif caps.coming == 0:
        plan_cap, plan_tpot, plan_rps = 0, 0.0, 0.0
    work_now = fc.work / max(1, n_ready)
    proven, fail, floor, floor_time = proof.proven, st.fail_work, st.floor, st.floor_time
    scale = cap.scale if cap is not None else st.cap_scale
    undone = replicas > current > 0 and st.last_down_time is not None \
        and now - st.last_down_time <= spec.stabilization_window_s
    if undone:   # a scale-down had to be undone: remember the work per replica that failed
        fail = work_now if fail <= 0 else min(fail, work_now)
        proven = min(proven, fail * (1 - spec.tolerance))
        floor, floor_time = max(floor, replicas), now
        if cap is not None and cap.usable > 0 and work_now > 0:
            scale = scale * min(1.0, work_now * (1 - spec.tolerance) / cap.usable)
    elif floor > 0 and floor_time is not None and now - floor_time >= spec.floor_quiet_s:
        floor, floor_time = floor - 1, now    # decays one replica per quiet period
        if floor <= max(1, spec.min_replicas):
            floor, fail, floor_time, scale = 0, 0.0, None, 1.0
    # unreachable pods: cannot tell, so busy; no rates yet (first scrape, a new leader): no evidence
    busy = not _idle(fleet) or (obs.router is not None and obs.router.held > 0) or bool(obs.unreachable)
    return replace(
        st, recommendations=[list(e) for e in win.recommendations], caps=dict(caps.caps),
        service_s=fleet.service_s if fleet.service_s is not None else st.service_s,
        since=win.since, plan_cap=plan_cap, plan_tpot_s=plan_tpot, plan_offered_rps=plan_rps,
        last_scale_time=now if replicas != current else st.last_scale_time,
        last_direction=(1 if replicas > current else -1) if replicas != current else st.last_direction,
        last_up_time=now if replicas > current else st.last_up_time,
        last_down_time=now if replicas < current else st.last_down_time,
        last_loading_time=now if caps.coming > 0 else st.last_loading_time,
        last_tick=now if metrics_ok else st.last_tick,
        level_rps=fc.level_rps if (metrics_ok and fleet.rated > 0) or st.level_rps is not None else None,
        trend_rps=fc.trend_rps, prompt_level=fc.prompt_level, output_level=fc.output_level,
        load_s=fc.load_s, proven_work=proven, proof=[[t, w] for t, w in proof.samples], fail_work=fail, floor=floor, floor_time=floor_time,
        last_busy=now if busy or st.last_busy is None else st.last_busy,
        cap_tokens=cap.tokens if cap is not None else st.cap_tokens,
        cap_var=cap.var if cap is not None else st.cap_var,
        cap_seen_s=cap.seen_s if cap is not None else st.cap_seen_s, cap_scale=scale,
        work_history=[list(e) for e in head.history] if head is not None else st.work_history,
        class_seen={c: t for c, t in {**st.class_seen, **{c: now for c in fleet.classes_now}}.items()
                    if now - t <= spec.stabilization_window_s},
        relief_cap=caps.relief_cap)


# -------------------------------------------------------------------------------------- decide


def decide(now: float, obs: Observation, spec: PolicySpec, state: PolicyState | None) -> Decision:
    """One autoscaling decision; see the module docstring for the rules and their sources.

    now: the caller's clock in seconds (monotonic or wall; only differences are used).
    Returns a Decision whose ``state`` must be passed to the next call. Never raises on odd
    observations (negative deltas are treated as 0 by the caller's counter-reset handling).
    """
    st = PolicyState.from_dict(state.to_dict()) if state is not None else PolicyState()
    caps = tune_batch_caps(obs, spec, st)
    rated = [p.interval_s for p in obs.ready if p.interval_s > 0]
    dt = now - st.last_tick if st.last_tick is not None and now > st.last_tick else _mean(rated, 0.0)
    cap = capacity(obs, dt, st.load_s if st.load_s > 0 else spec.model_load_s, spec, st)
    fleet = aggregate(now, obs, caps, spec, st, cap.p_max)
    metrics_ok = not obs.unreachable and fleet.rated > 0
    sz = sized = size(fleet, caps, len(obs.ready), spec, st)
    if spec.prefill_pool:   # rule 18: sized by prompt tokens at rule 11's smoothed rate
        first = backlog_rate(obs, fleet, caps.coming, st)   # a cold pool: the rate over its pods' life
        if first is not None:
            sz = sized = replace(sized, sizing_rps=first)
        level = forecast(now, obs, fleet, caps, sized, metrics_ok, spec, st).level_rps
        sz = prefill_size(obs, fleet, sized, cap, level, spec, st)
    fc = forecast(now, obs, fleet, caps, sz, metrics_ok, spec, st)
    head = headroom(now, dt, fleet, fc, metrics_ok, spec, st)
    proof = proven_work(now, fleet, caps, sz, fc, len(obs.ready), metrics_ok, spec, st)
    keep = fewest_carrying(obs.current_replicas, proof.proven, fleet, sz, fc, spec, st, cap, head)
    win = windows(now, obs.current_replicas, sz, fc, keep, metrics_ok, spec, st)
    out = choose_replicas(now, obs, fleet, caps, sz, fc, win, proof.proven, metrics_ok, spec, st, cap, head)
    settling = st.relief_until is not None and now < st.relief_until
    if (caps.relief_cap or st.relief_cap or settling) and out.replicas != obs.current_replicas and \
            spec.min_replicas <= obs.current_replicas <= spec.max_replicas:
        out = Replicas(obs.current_replicas, "HoldPrefillStarting")   # rule 19: the prefill pods are coming
    token_rate = cap.tokens * cap.scale     # rule 5 in prompt tokens (0 before any measurement)
    if sz is not sized:     # rule 18: a prefill pod serves one prompt at a time
        ql = queue_limits(replace(fleet, live_capacity=1.0), len(obs.ready), caps.coming,
                          out.replicas - obs.current_replicas, spec, sz.service_s, token_rate)
    else:
        ql = queue_limits(fleet, len(obs.ready), caps.coming, out.replicas - obs.current_replicas, spec,
                          fleet.service_s if fleet.service_s is not None else st.service_s, token_rate)
    limits = {p.name: Limits(caps.caps[p.name], ql.max_waiting, ql.max_waiting_tokens) for p in obs.ready}
    message = _message(obs, fleet, caps, sz, fc, out, spec, st, cap, head)
    nxt = next_state(now, obs, fleet, caps, sz, fc, win, proof, out, metrics_ok, spec, st, cap, head)
    if st.relief_cap and not caps.relief_cap:   # rule 19: the prefill pods arrived; what the decode
        # pods admitted meanwhile finishes over the next interval and TTFT budgets
        nxt = replace(nxt, relief_until=now + dt + spec.queue_slack * spec.slo_ttft_s)
    elif not settling:
        nxt = replace(nxt, relief_until=None)
    return Decision(out.replicas, limits, out.reason, message,
                    conditions(obs, fleet, metrics_ok, out.reason, message, spec),
                    nxt,
                    ql.router_max_queued, fleet.infeasible, cap.tokens * cap.scale if cap.ready else 0.0)


def _message(obs: Observation, fleet: Fleet, caps: BatchCaps, sz: Size, fc: Forecast, out: Replicas,
             spec: PolicySpec, st: PolicyState, cap: Capacity | None = None, head: Headroom | None = None) -> str:
    """The numbers behind the replica decision, without its reason (``Decision.reason`` says it) and
    without the admission limits (``Decision.limits``; the loop bounds them by the spec and reports
    the ones in force)."""
    att = "n/a" if fleet.attainment is None else f"{fleet.attainment:.3f}"
    floor = f", floor {st.floor}" if st.floor else ""
    if cap is not None and cap.ready:
        floor += (f", capacity {cap.tokens * cap.scale:.0f} tokens/s per replica (+-{cap.sd:.0f}), "
                  f"work {fc.work_fc:.0f} tokens/s")
    if head is not None and head.ratio > 1:
        floor += f", spike headroom {head.ratio:.2f}x"
    if fleet.infeasible > 0:
        floor += f", infeasible {fleet.infeasible:.0f}"
    return (f"{obs.current_replicas} -> {out.replicas} replicas ({len(obs.ready)} ready, "
            f"{caps.coming} starting); offered {fleet.offered_rps:.2f} req/s (forecast {fc.rps:.2f} in "
            f"{fc.horizon_s:.0f} s), in flight {fleet.in_flight}, demand {sz.demand:.1f} seqs, "
            f"{sz.per_replica:.1f} seqs per replica, attainment {att} (target {spec.attainment_target}), "
            f"rejected {fleet.rejected:.0f}, preemptions {fleet.preempted:.0f}{floor}")


__all__ = ["HistogramDelta", "PodObservation", "StartingPod", "RouterObservation", "Observation",
           "attainment", "PolicyState", "Limits",
           "Decision", "BatchCaps", "Fleet", "Size", "Forecast", "Proof", "Windows", "Replicas", "QueueLimits",
           "Capacity", "Headroom", "pod_token_rate", "capacity", "infeasible", "prefill_size", "prefill_relief", "peak_to_mean", "headroom",
           "backlog_rate",
           "SPIKE_NOISE_SD", "SHORT_SPIKE", "short_spikes", "short_spike_limit", "last_horizon", "spikes_were_short",
           "tune_cap", "tpot_met", "strictest_tpot", "classes_present", "queue_ttft", "replica_capacity", "tune_batch_caps", "aggregate", "size", "forecast", "windows",
           "proven_work", "carries", "fewest_carrying", "choose_replicas", "queue_limits", "conditions", "next_state", "decide"]
