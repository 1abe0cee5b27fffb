/* reflexsim replay viewer.
 * Run data (model output above all) is untrusted text: it reaches the page only through
 * text nodes and textContent, never through innerHTML or attribute-parsed HTML. */
"use strict";
(() => {
  const root = document.getElementById("app");
  const MODE = root.dataset.mode === "static" ? "static" : "served";
  const POLL_MS = 2000;
  const state = {
    data: null,
    filters: { type: "", arm: "", outcome: "" },
    openStep: null,
    timer: null,
    shown: "",
  };

  // -- DOM helpers -------------------------------------------------------------------------
  function h(tag, props, ...kids) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = String(value);
      else if (key === "testid") node.dataset.testid = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, String(value));
    }
    put(node, ...kids);
    return node;
  }
  function put(node, ...kids) {
    for (const kid of kids.flat()) {
      if (kid === null || kid === undefined || kid === false) continue;
      node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
  }
  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }
  function pct(x) {
    return (100 * x).toFixed(1) + "%";
  }
  function has(obj, key) {
    return obj !== null && typeof obj === "object" && Object.prototype.hasOwnProperty.call(obj, key);
  }
  function table(header, rows, testid) {
    return h(
      "table",
      { testid },
      h("thead", null, h("tr", null, header.map((c) => h("th", { text: c })))),
      h("tbody", null, rows.map((r) => h("tr", null, r.map((c) => h("td", null, c))))),
    );
  }

  // -- data --------------------------------------------------------------------------------
  async function getJSON(url) {
    const response = await fetch(url, { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    return response.json();
  }
  async function loadIndex() {
    if (MODE === "static") {
      return JSON.parse(document.getElementById("reflexsim-data").textContent);
    }
    return getJSON("/api/run");
  }
  async function loadEpisode(runId, id) {
    if (MODE === "static") {
      const perRun = state.data.details[String(runId)];
      return has(perRun, id) ? perRun[id] : null;
    }
    try {
      return await getJSON("/api/episode?id=" + encodeURIComponent(id));
    } catch (err) {
      return null;
    }
  }
  async function loadPrompt(detail, index) {
    // The request the step answered, as the run recorded it (or rebuilt, in an older store).
    if (MODE === "static") {
      // each step's text keeps a leading part of the one before (step 0: of the prefix)
      let prompt = state.data.prefixes[detail.prefix_ref];
      for (const s of detail.steps.slice(0, index + 1)) {
        prompt = prompt.slice(0, s.prompt_keep) + s.prompt_add;
      }
      return { prompt: prompt, source: detail.steps[index].prompt_source };
    }
    const url = `/api/prompt?id=${encodeURIComponent(detail.id)}&step=${index}`;
    return await getJSON(url);
  }
  function runById(runId) {
    return state.data.runs.find((r) => String(r.id) === String(runId)) || null;
  }

  // -- outcomes ----------------------------------------------------------------------------
  function outcomeOf(ep) {
    if (ep.won) return "won";
    if (ep.status === "error") return "error";
    if (ep.status === "running" || ep.status === "interrupted") return "running";
    return "failed";
  }
  const OUTCOME_TEXT = { won: "✓ won", failed: "✗ failed", error: "! error", running: "… running" };

  function tasksOf(run) {
    const tasks = new Map();
    for (const ep of run.episodes) {
      if (!tasks.has(ep.game)) tasks.set(ep.game, { run, game: ep.game, type: ep.task_type, byTrial: {} });
      tasks.get(ep.game).byTrial[ep.trial] = ep;
    }
    for (const t of run.trials) {
      for (const game of t.tasks) {
        if (!tasks.has(game)) tasks.set(game, { run, game, type: "", byTrial: {} });
      }
    }
    return [...tasks.values()];
  }
  function taskOutcome(task) {
    const eps = Object.values(task.byTrial);
    if (eps.some((e) => e.won)) return "solved";
    if (eps.some((e) => e.status === "running" || e.status === "interrupted")) return "running";
    if (eps.some((e) => e.status === "error")) return "error";
    return "unsolved";
  }
  function episodeLink(run, id) {
    return `#/episode/${run.id}/${encodeURIComponent(id)}`;
  }
  function compareLink(run, game, trial) {
    return `#/compare/${run.id}/${encodeURIComponent(game)}/${trial}`;
  }

  // -- overview ----------------------------------------------------------------------------
  function runHeader(run) {
    const s = run.summary || {};
    const status = !run.status
      ? "in progress (or interrupted)"
      : run.status.stopped
        ? "stopped: " + run.status.stopped
        : run.status.status;
    return h(
      "div",
      { class: "run-header", testid: "run-header" },
      h("h2", null, run.label),
      h(
        "p",
        null,
        h("span", { class: "tag", text: "model " + run.model }),
        h("span", { class: "tag", text: "arm " + run.arm }),
        h("span", { class: "tag", text: "evaluator " + run.evaluator }),
        h("span", { class: "tag", text: status }),
      ),
      s.total_tasks === undefined
        ? null
        : h(
            "p",
            null,
            `Solved ${s.solved} of ${s.total_tasks} tasks (${pct(s.success_rate)}), cumulative over ` +
              `${s.trials.length} trial(s); ${s.errors} errored episode(s) (harness, not agent). ` +
              `Tokens: ${s.tokens.prompt} prompt (${s.tokens.cached_prompt} cached), ` +
              `${s.tokens.completion} completion; cost $${Number(s.cost_usd).toFixed(4)}; ` +
              `wall ${Math.round(s.wall_s)} s.`,
          ),
    );
  }
  function summaryTables(run) {
    const s = run.summary;
    if (!s) return null;
    const ci = (c) => (Array.isArray(c) ? `${(100 * c[0]).toFixed(1)}–${(100 * c[1]).toFixed(1)}%` : "–");
    const trials = table(
      ["trial", "tasks run", "newly solved", "cumulative solved", "success", "95% CI", "errors"],
      s.trials.map((t) => [
        String(t.trial),
        String(t.tasks_run),
        String(t.newly_solved),
        String(t.cumulative_solved),
        pct(t.success_rate),
        ci(t.success_ci),
        String(t.errors),
      ]),
      "trials-table",
    );
    const types = table(
      ["task type", "tasks", "solved", "success"],
      Object.keys(s.by_task_type)
        .sort()
        .map((k) => {
          const v = s.by_task_type[k];
          return [k, String(v.total), String(v.solved), pct(v.total ? v.solved / v.total : 0)];
        }),
      "type-table",
    );
    const failures = table(
      ["failure class", "episodes"],
      Object.keys(s.failure_classes).map((k) => [k, String(s.failure_classes[k])]),
      "failure-table",
    );
    return h(
      "div",
      { class: "summary" },
      h("div", null, h("h3", { text: "Trials (cumulative success)" }), trials),
      h("div", null, h("h3", { text: "By task type" }), types),
      h("div", null, h("h3", { text: "Failure classes" }), failures),
    );
  }
  function listText(items) {
    return Array.isArray(items) ? items.map(String).join(", ") : "";
  }
  function runExperience(run) {
    // A gathering run's rule list per extraction step; a run shown experience: its source and
    // success per task type. Rule operations and ignored lines are model output (text only).
    const x = run.experience;
    if (!x) return null;
    const parts = [];
    if (Array.isArray(x.rule_growth)) {
      parts.push(
        h("h3", { text: "Rules extracted (growth per step)" }),
        table(
          ["step", "task type", "games", "applied", "ignored", "rules after"],
          x.rule_growth.map((g) => [
            String(g.step), String(g.task_type), listText(g.games),
            h("span", { class: "model-text", text: listText(g.applied) }),
            h("span", { class: "model-text", text: listText(g.ignored) }),
            String(g.rules_after),
          ]),
          "rule-growth",
        ),
      );
    }
    if (x.experience) {
      const e = x.experience;
      parts.push(
        h("h3", { text: "Experience used" }),
        h("p", { testid: "experience-source" },
          h("span", { class: "tag", text: "from " + e.run }),
          h("span", { class: "tag", text: "split " + e.split }),
          h("span", { class: "tag", title: String(e.digest), text: "digest " + String(e.digest).slice(0, 12) })),
        table(
          ["task type", "games", "success trial 0", "success final"],
          Object.keys(x.success_by_type || {}).sort().map((k) => {
            const v = x.success_by_type[k];
            return [k, String(v.games), pct(v.trial0), pct(v.final)];
          }),
          "experience-success",
        ),
      );
    }
    return parts.length ? h("section", { class: "experience", testid: "run-experience" }, parts) : null;
  }
  function comparisonTable(rows) {
    const money = (x) => (x === null || x === undefined ? "–" : "$" + Number(x).toFixed(4));
    const num = (x) => (x === null || x === undefined ? "–" : String(Math.round(x)));
    return h(
      "section",
      null,
      h("h2", { text: "Model comparison" }),
      table(
        ["run", "model", "arm", "tasks", "success trial 0", "success last trial", "tokens / solved",
          "cost / solved", "wall", "errors"],
        rows.map((r) => [
          r.label, r.model, r.arm, String(r.total_tasks), pct(r.success_trial0),
          `${pct(r.success_last)} (trial ${r.last_trial})`, num(r.tokens_per_solved),
          money(r.cost_per_solved), `${Math.round(r.wall_s)} s`, String(r.errors),
        ]),
        "comparison-table",
      ),
    );
  }
  function plots() {
    const images = [];
    for (const [name, alt] of [["learning_curve", "learning curve"], ["failures", "failure classes per trial"], ["compute", "success at equal compute"]]) {
      const src = state.data.plots && state.data.plots[name];
      if (typeof src === "string" && src.startsWith("data:image/png;base64,")) {
        images.push(h("img", { src, alt, class: "plot", testid: "plot-" + name }));
      }
    }
    return images.length ? h("section", { class: "plots" }, images) : null;
  }
  function taskTypes(tasks) {
    return [...new Set(tasks.map((t) => t.type).filter(Boolean))].sort();
  }
  function select(label, key, options) {
    const node = h(
      "select",
      {
        testid: "filter-" + key,
        onchange: (ev) => {
          state.filters[key] = ev.target.value;
          renderTaskRows();
        },
      },
      h("option", { value: "", text: "all" }),
      options.map((o) => h("option", { value: o, text: o })),
    );
    node.value = state.filters[key];
    return h("label", null, label + " ", node);
  }
  function taskList() {
    const tasks = state.data.runs.flatMap(tasksOf);
    const arms = [...new Set(state.data.runs.map((r) => r.arm))].sort();
    return h(
      "section",
      { class: "tasks" },
      h("h2", { text: "Tasks" }),
      h(
        "div",
        { class: "filters" },
        select("task type", "type", taskTypes(tasks)),
        select("arm", "arm", arms),
        select("outcome", "outcome", ["solved", "unsolved", "error", "running"]),
        h("span", { class: "count", testid: "task-count" }),
      ),
      h("table", { class: "task-table", testid: "task-table" }),
    );
  }
  function renderTaskRows() {
    const tableNode = root.querySelector('[data-testid="task-table"]');
    if (!tableNode) return;
    clear(tableNode);
    const f = state.filters;
    const tasks = state.data.runs.flatMap(tasksOf).filter((t) => {
      if (f.type && t.type !== f.type) return false;
      if (f.arm && t.run.arm !== f.arm) return false;
      if (f.outcome === "unsolved") return taskOutcome(t) !== "solved";
      if (f.outcome && taskOutcome(t) !== f.outcome) return false;
      return true;
    });
    let maxTrial = 0;
    for (const run of state.data.runs) {
      for (const ep of run.episodes) maxTrial = Math.max(maxTrial, ep.trial);
      for (const t of run.trials) maxTrial = Math.max(maxTrial, t.trial);
    }
    const trialNumbers = [...Array(maxTrial + 1).keys()];
    const multi = state.data.runs.length > 1;
    tableNode.append(
      h(
        "thead",
        null,
        h(
          "tr",
          null,
          multi ? h("th", { text: "run" }) : null,
          h("th", { text: "task" }),
          h("th", { text: "type" }),
          trialNumbers.map((k) => h("th", { text: "trial " + k })),
        ),
      ),
    );
    const body = h("tbody");
    for (const task of tasks) {
      let solvedAt = null;
      const cells = trialNumbers.map((k) => {
        const ep = task.byTrial[k];
        if (!ep) {
          return h("td", { class: solvedAt !== null ? "cell solved-earlier" : "cell", text: solvedAt !== null ? "·" : "" });
        }
        if (ep.won && solvedAt === null) solvedAt = k;
        const outcome = outcomeOf(ep);
        const title = [ep.failure_class, ep.verdict, `${ep.steps} steps`].filter(Boolean).join(" · ");
        return h(
          "td",
          { class: "cell " + outcome },
          h("a", { href: episodeLink(task.run, ep.id), title, testid: "cell", "data-trial": k, "data-outcome": outcome },
            OUTCOME_TEXT[outcome]),
          k > 0 && task.byTrial[0]
            ? h("a", { href: compareLink(task.run, task.game, k), class: "vs", testid: "compare-link", title: "side by side with trial 0" }, "vs 0")
            : null,
        );
      });
      body.append(
        h(
          "tr",
          { testid: "task-row", "data-game": task.game },
          multi ? h("td", { text: task.run.label }) : null,
          h("td", { class: "game", text: task.game }),
          h("td", { text: task.type }),
          cells,
        ),
      );
    }
    tableNode.append(body);
    const count = root.querySelector('[data-testid="task-count"]');
    if (count) count.textContent = `${tasks.length} task(s)`;
  }
  function renderOverview() {
    clear(root);
    put(root, 
      h("h1", { text: "reflexsim replay" }),
      state.data.comparison ? comparisonTable(state.data.comparison) : null,
      state.data.runs.map((run) => h("section", { class: "run" }, runHeader(run), summaryTables(run), runExperience(run))),
      plots(),
      taskList(),
    );
    renderTaskRows();
  }

  // -- one episode -------------------------------------------------------------------------
  function kindText(step) {
    if (step.kind === "think") return "thought";
    if (step.kind === "invalid") return "invalid";
    return step.admissible ? "action" : "inadmissible";
  }
  function stepClasses(step) {
    const classes = ["step", "kind-" + step.kind];
    if (step.kind === "act" && !step.admissible) classes.push("inadmissible");
    if (step.mapped) classes.push("mapped");
    if (step.won) classes.push("won");
    return classes.join(" ");
  }
  function mappedBadge(step) {
    // the executed command is not what the model wrote: nearest decoding chose it
    return h("span", {
      class: "badge mapped-badge",
      testid: "mapped",
      title: "the model wrote: " + step.raw_output.trim().split("\n")[0],
      text: "mapped",
    });
  }
  function actionText(step) {
    if (step.kind === "think") return step.action.replace(/^think:\s*/i, "");
    if (step.kind === "invalid") return "(no action: unparseable output)";
    return step.action;
  }
  function memoryList(memory, heading, testid) {
    return h(
      "section",
      { class: "memory", testid },
      h("h3", { text: heading }),
      memory.length
        ? h("ol", null, memory.map((r) => h("li", null, h("span", { class: "trial-tag", text: `trial ${r.trial}` }), h("div", { class: "model-text", text: r.text }))))
        : h("p", { class: "muted", text: "(none)" }),
    );
  }
  function experienceShown(x) {
    // What the episode's prompt was shown of other games, as recorded when it was made; a rule's
    // text is model output (text only).
    if (!x) return null;
    const rules = Array.isArray(x.rules) ? x.rules : [];
    const retrieved = Array.isArray(x.retrieved) ? x.retrieved : [];
    const score = (v) => (typeof v === "number" ? v.toFixed(3) : "–");
    return h(
      "section",
      { class: "memory experience", testid: "experience-shown" },
      h("h3", { text: "Experience shown" }),
      h("h4", { text: `Rules (${rules.length})` }),
      rules.length
        ? h("ol", { testid: "shown-rules" }, rules.map((r) => h("li", { testid: "shown-rule" },
            h("span", { class: "trial-tag", text: `${r.task_type} · ${r.votes} vote(s)` }),
            h("div", { class: "model-text", text: r.text }))))
        : h("p", { class: "muted", text: "(none)" }),
      h("h4", { text: `Retrieved trajectories (${retrieved.length})` }),
      retrieved.length
        ? table(
            ["game", "trial", "task type", "score"],
            retrieved.map((r) => [String(r.game), String(r.trial), String(r.task_type), score(r.score)]),
            "shown-retrieved",
          )
        : h("p", { class: "muted", text: "(none: the packaged examples)" }),
    );
  }
  function field(label, value, testid) {
    if (value === null || value === undefined || value === "") return null;
    return [h("dt", { text: label }), h("dd", { text: String(value), testid })];
  }
  function attemptErrors(errors) {
    if (!errors || !errors.length) return null;
    return h(
      "section",
      { class: "attempt-errors", testid: "attempt-errors" },
      h("h3", { text: `Harness errors (${errors.length})` }),
      ...errors.map((e) =>
        h(
          "details",
          { testid: "attempt-error" },
          h("summary", { text: `attempt ${e.attempt} · ${e.kind}: ${e.error}` }),
          h("pre", { class: "traceback", text: e.traceback }),
        ),
      ),
    );
  }
  function outcomeBadge(detail) {
    const outcome = outcomeOf(detail);
    return h("span", { class: "badge " + outcome, testid: "outcome", text: OUTCOME_TEXT[outcome] });
  }
  function stepDetail(detail, step) {
    const promptBox = h("pre", { class: "prompt hidden", testid: "prompt" });
    const sourceNote = h("p", { class: "prompt-source hidden", testid: "prompt-source" });
    const button = h("button", {
      type: "button",
      testid: "show-prompt",
      text: "Show the exact prompt",
      onclick: async (ev) => {
        ev.stopPropagation();
        if (!promptBox.classList.contains("hidden")) {
          promptBox.classList.add("hidden");
          sourceNote.classList.add("hidden");
          button.textContent = "Show the exact prompt";
          return;
        }
        button.textContent = "Loading…";
        try {
          const got = await loadPrompt(detail, step.index);
          promptBox.textContent = got.prompt;
          sourceNote.textContent =
            got.source === "rebuilt"
              ? "rebuilt from the steps: this run's store did not record the request"
              : "as sent";
        } catch (err) {
          promptBox.textContent = "could not load the prompt: " + err.message;
        }
        sourceNote.classList.remove("hidden");
        promptBox.classList.remove("hidden");
        button.textContent = "Hide the prompt";
      },
    });
    return h(
      "div",
      { class: "step-detail", testid: "step-detail", onclick: (ev) => ev.stopPropagation() },
      h(
        "dl",
        null,
        field("step", step.index),
        field("kind", kindText(step), "detail-kind"),
        h("dt", { text: "model output (raw)" }),
        h("dd", null, h("pre", { class: "model-text", testid: "raw-output", text: step.raw_output })),
        field(step.kind === "think" ? "thought" : "executed action", step.action, "detail-action"),
        step.mapped ? field("decoding", "mapped to the nearest admissible command", "detail-mapped") : null,
        h("dt", { text: "observation" }),
        h("dd", null, h("pre", { testid: "detail-observation", text: step.observation })),
        field("admissible", step.admissible ? "yes" : "no"),
        field("tokens", `${step.prompt_tokens} prompt (${step.cached_tokens} cached), ${step.completion_tokens} completion`),
        field("latency", `${Number(step.latency_s).toFixed(3)} s`),
      ),
      button,
      sourceNote,
      promptBox,
    );
  }
  function stepsTable(run, detail) {
    const body = h("tbody");
    for (const step of detail.steps) {
      const row = h(
        "tr",
        { class: stepClasses(step), testid: "step", "data-index": step.index, tabindex: 0 },
        h("td", { class: "idx", text: String(step.index) }),
        h("td", { class: "kind", text: kindText(step) }),
        h(
          "td",
          { class: "action model-text", text: actionText(step) },
          step.mapped ? mappedBadge(step) : null,
        ),
        h("td", { class: "obs", text: step.observation }),
      );
      const toggle = () => {
        const next = row.nextElementSibling;
        if (next && next.classList.contains("detail-row")) {
          next.remove();
          state.openStep = null;
          return;
        }
        for (const other of body.querySelectorAll(".detail-row")) other.remove();
        row.after(h("tr", { class: "detail-row" }, h("td", { colspan: 4 }, stepDetail(detail, step))));
        state.openStep = step.index;
        history.replaceState(null, "", `${episodeLink(run, detail.id)}/${step.index}`);
      };
      row.addEventListener("click", toggle);
      row.addEventListener("keydown", (ev) => {
        if (ev.key === "Enter") toggle();
      });
      body.append(row);
    }
    return h(
      "table",
      { class: "steps", testid: "steps" },
      h("thead", null, h("tr", null, ["#", "kind", "thought / action", "observation"].map((c) => h("th", { text: c })))),
      body,
    );
  }
  function modelCalls(calls) {
    // Every model call made for the episode, as recorded; a step's prompt is shown with its step.
    if (!calls || !calls.length) return null;
    const items = calls.map((c) => {
      const where = c.step === null || c.step === undefined ? `trial ${c.trial}` : `step ${c.step}`;
      const cost = `${c.prompt_tokens} prompt, ${c.completion_tokens} completion tokens, ${Number(c.latency_s).toFixed(3)} s`;
      const retried = c.retries ? `, ${c.retries} retries` : "";
      const request = c.messages
        ? c.messages.map((m) => `[${m.role}]\n${m.content}`).join("\n\n")
        : c.prompt;
      return h(
        "li",
        { testid: "model-call" },
        h("strong", { text: c.purpose }),
        ` (${where}): ${cost}${retried}`,
        c.recorded ? null : h("em", { text: " (request not recorded in this store)" }),
        c.error ? h("div", { class: "error", text: c.error }) : null,
        c.attempt_errors.length ? h("ul", null, c.attempt_errors.map((e) => h("li", { class: "error", text: e }))) : null,
        request !== undefined && request !== null
          ? h("details", null, h("summary", { text: "prompt" }), h("pre", { class: "prompt", testid: "call-prompt", text: request }))
          : null,
        c.answer !== null ? h("pre", { class: "model-text", testid: "call-answer", text: c.answer }) : null,
      );
    });
    return h("section", { class: "calls", testid: "model-calls" }, h("h3", { text: `Model calls (${calls.length})` }), h("ol", null, items));
  }
  function otherTrials(run, detail) {
    const eps = run.episodes.filter((e) => e.game === detail.game).sort((a, b) => a.trial - b.trial);
    return h(
      "p",
      { class: "trials-nav" },
      "Trials: ",
      eps.map((e) => [
        e.id === detail.id
          ? h("strong", { text: `${e.trial}` })
          : h("a", { href: episodeLink(run, e.id), text: `${e.trial}` }),
        " ",
      ]),
      detail.trial > 0 && eps.some((e) => e.trial === 0)
        ? h("a", { href: compareLink(run, detail.game, detail.trial), testid: "compare-link", class: "vs" }, `side by side with trial 0`)
        : null,
    );
  }
  async function renderEpisode(runId, id, stepIndex) {
    const run = runById(runId);
    const detail = run ? await loadEpisode(runId, id) : null;
    clear(root);
    put(root, h("p", null, h("a", { href: "#/", testid: "back", text: "← all tasks" })));
    if (!detail) {
      put(root, h("p", { class: "error", text: "no such episode: " + id }));
      return null;
    }
    put(root, 
      h(
        "section",
        { class: "episode", testid: "episode" },
        h("h2", null, outcomeBadge(detail), " ", h("span", { class: "game", text: detail.game })),
        otherTrials(run, detail),
        h(
          "dl",
          { class: "facts" },
          field("task", detail.task, "task"),
          field("type", detail.task_type),
          field("trial", detail.trial, "trial"),
          field("arm", detail.arm),
          field("status", detail.status),
          field("failure class", detail.failure_class, "failure-class"),
          field("evaluator verdict", detail.verdict, "verdict"),
          field("judge (LLM) verdict", detail.judge_verdict && `${detail.judge_verdict}${detail.judge_reason ? ": " + detail.judge_reason : ""}`, "judge"),
          field("harness error", detail.error, "error"),
          field("attempts", detail.attempts > 1 ? detail.attempts : null),
          field("re-simulated", detail.resimulated || null),
        ),
        attemptErrors(detail.attempt_errors),
        memoryList(detail.memory, "Reflections in this episode's prompt", "memory"),
        experienceShown(detail.experience),
        detail.reflection
          ? h("section", { class: "memory", testid: "reflection-after" }, h("h3", { text: "Reflection written after this trial" }), h("div", { class: "model-text", text: detail.reflection.text }))
          : null,
        h("h3", { text: "First observation" }),
        h("pre", { class: "observation", testid: "first-observation", text: detail.observation }),
        h("h3", { text: `Steps (${detail.steps.length})` }),
        stepsTable(run, detail),
        modelCalls(detail.calls),
        detail.tree ? searchTree(detail.tree) : null,
      ),
    );
    const open = stepIndex !== null ? stepIndex : state.openStep;
    if (open !== null) {
      const row = root.querySelector(`tr[data-testid="step"][data-index="${Number(open)}"]`);
      if (row) row.click();
    }
    return detail;
  }

  // -- search tree (LATS) ------------------------------------------------------------------
  function num(x, digits) {
    return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
  }
  function treeNodeLabel(node, hidden) {
    const classes = ["tree-node"];
    if (node.chosen) classes.push("chosen");
    if (node.won) classes.push("won");
    else if (node.terminal) classes.push("dead-end");
    const what = node.parent_id === null ? "(start)" : node.kind === "invalid" ? "(unparseable output)" : node.action;
    return h(
      "div",
      { class: classes.join(" "), testid: "tree-node", "data-node": node.node_id, "data-chosen": node.chosen ? "1" : "0" },
      h("span", { class: "node-action model-text", text: what }),
      h("span", { class: "node-stats", text: ` · value ${num(node.value, 2)} · visits ${node.visits} · mean ${num(node.mean, 2)}` + (node.samples > 1 ? ` · ${node.samples} samples` : "") }),
      node.won ? h("span", { class: "node-tag won", text: " ✓ won" }) : null,
      !node.won && node.terminal ? h("span", { class: "node-tag failed", text: " ✗ dead end" }) : null,
      node.backtrack ? h("span", { class: "node-tag backtrack", testid: "backtrack", text: " ↩ backtracked here" }) : null,
      hidden ? h("span", { class: "muted", text: ` · ${hidden} candidate(s) never executed` }) : null,
      node.executed && node.parent_id !== null ? h("div", { class: "node-obs", text: node.observation }) : null,
      node.reflection ? h("div", { class: "node-reflection model-text", testid: "node-reflection", text: "reflection: " + node.reflection }) : null,
    );
  }
  function searchTree(tree) {
    const children = new Map();
    for (const node of tree.nodes) {
      const key = node.parent_id === null ? "root" : String(node.parent_id);
      if (!children.has(key)) children.set(key, []);
      children.get(key).push(node);
    }
    const build = (node) => {
      const kids = children.get(String(node.node_id)) || [];
      const shown = kids.filter((k) => k.executed);
      return h(
        "li",
        null,
        treeNodeLabel(node, kids.length - shown.length),
        shown.length ? h("ul", null, shown.map(build)) : null,
      );
    };
    const roots = children.get("root") || [];
    const its = tree.iterations;
    const backtracks = its.filter((i) => i.backtrack).length;
    const env = its.reduce((a, i) => a + i.env_steps, 0);
    const replays = its.reduce((a, i) => a + i.replay_steps, 0);
    return h(
      "section",
      { class: "search-tree", testid: "tree" },
      h("h3", { text: "Search tree" }),
      h(
        "p",
        { testid: "tree-summary" },
        `${tree.nodes.length} nodes, ${its.length} iteration(s), ${backtracks} backtrack(s); ` +
          `env steps ${env + replays} (${replays} replayed to restore nodes)` +
          (tree.end ? `; ended: ${tree.end.reason}` : "; still searching"),
      ),
      h("p", { class: "muted", text: "The chosen path (written as the episode's steps) is highlighted." }),
      h("ul", { class: "tree" }, roots.map(build)),
      table(
        ["iteration", "selected", "leaf", "reward", "env steps", "replayed", "backtrack"],
        its.map((i) => [String(i.iteration), String(i.selected), String(i.leaf), num(i.reward, 2), String(i.env_steps), String(i.replay_steps), i.backtrack ? "yes" : ""]),
        "iterations-table",
      ),
    );
  }

  // -- side by side ------------------------------------------------------------------------
  function compactSteps(detail) {
    return h(
      "ol",
      { class: "compact", start: 0 },
      detail.steps.map((s) =>
        h(
          "li",
          { class: stepClasses(s) },
          h("div", { class: "action model-text", text: (s.kind === "act" ? "> " : s.kind === "think" ? "think: " : "") + actionText(s) + (s.kind === "act" && !s.admissible ? "   [not admissible]" : "") + (s.mapped ? "   [mapped]" : "") }),
          h("div", { class: "obs", text: s.observation }),
        ),
      ),
    );
  }
  async function renderCompare(runId, game, trial) {
    const run = runById(runId);
    clear(root);
    put(root, h("p", null, h("a", { href: "#/", testid: "back", text: "← all tasks" })));
    const eps = run ? run.episodes.filter((e) => e.game === game) : [];
    const first = eps.find((e) => e.trial === 0);
    const later = eps.find((e) => e.trial === trial);
    if (!first || !later) {
      put(root, h("p", { class: "error", text: `no trials 0 and ${trial} for ${game}` }));
      return;
    }
    const [a, b] = await Promise.all([loadEpisode(runId, first.id), loadEpisode(runId, later.id)]);
    if (!a || !b) {
      put(root, h("p", { class: "error", text: "episode not found" }));
      return;
    }
    const column = (detail, extra) =>
      h(
        "div",
        { class: "column", testid: "compare-trial-" + detail.trial },
        h("h3", null, h("a", { href: episodeLink(run, detail.id), text: `Trial ${detail.trial}` }), " ", outcomeBadge(detail)),
        detail.failure_class ? h("p", { class: "muted", text: [detail.failure_class, detail.verdict].filter((x, i, a) => x && a.indexOf(x) === i).join(" · ") }) : null,
        extra,
        compactSteps(detail),
      );
    put(root, 
      h(
        "section",
        { class: "compare", testid: "compare" },
        h("h2", null, h("span", { class: "game", text: game }), `: trial 0 vs trial ${trial}`),
        h(
          "p",
          { class: "trials-nav" },
          "Compare with trial: ",
          eps.filter((e) => e.trial > 0).sort((x, y) => x.trial - y.trial).map((e) => [
            e.trial === trial ? h("strong", { text: String(e.trial) }) : h("a", { href: compareLink(run, game, e.trial), text: String(e.trial) }),
            " ",
          ]),
        ),
        h("div", { class: "columns" }, column(a, null), column(b, memoryList(b.memory, `Reflections in trial ${trial}'s prompt`, "memory"))),
      ),
    );
  }

  // -- routing and refresh -----------------------------------------------------------------
  function route() {
    const raw = location.hash.replace(/^#\/?/, "");
    let parts;
    try {
      parts = raw ? raw.split("/").map(decodeURIComponent) : [];
    } catch (err) {
      parts = [];
    }
    if (parts[0] === "episode" && parts.length >= 3) {
      const step = parts.length >= 4 && /^\d+$/.test(parts[3]) ? Number(parts[3]) : null;
      return { view: "episode", run: parts[1], id: parts[2], step };
    }
    if (parts[0] === "compare" && parts.length >= 4 && /^\d+$/.test(parts[3])) {
      return { view: "compare", run: parts[1], game: parts[2], trial: Number(parts[3]) };
    }
    return { view: "overview" };
  }
  async function render(fromHashChange) {
    const r = route();
    if (fromHashChange) state.openStep = null;
    let live = false;
    if (r.view === "episode") {
      const detail = await renderEpisode(r.run, r.id, fromHashChange ? r.step : null);
      live = !!detail && (detail.status === "running" || detail.status === "interrupted");
      state.shown = detail ? JSON.stringify(detail) : "";
    } else if (r.view === "compare") {
      await renderCompare(r.run, r.game, r.trial);
    } else {
      renderOverview();
      live = state.data.runs.some(
        (run) => !run.status || ["running", "interrupted"].includes(run.status.status),
      );
    }
    schedule(live);
  }
  function schedule(live) {
    if (state.timer) clearTimeout(state.timer);
    state.timer = null;
    if (MODE !== "served" || !live) return;
    state.timer = setTimeout(refresh, POLL_MS);
  }
  async function refresh() {
    // A run that is still being written: reload, and redraw only if something changed.
    try {
      const r = route();
      if (r.view === "episode") {
        const detail = await loadEpisode(r.run, r.id);
        const text = detail ? JSON.stringify(detail) : "";
        state.data = await loadIndex();
        if (text !== state.shown) await render(false);
        else schedule(true);
      } else if (r.view === "overview") {
        const before = JSON.stringify(state.data);
        state.data = await loadIndex();
        if (JSON.stringify(state.data) !== before) await render(false);
        else schedule(true);
      }
    } catch (err) {
      schedule(true);
    }
  }

  async function start() {
    try {
      state.data = await loadIndex();
    } catch (err) {
      clear(root);
      put(root, h("p", { class: "error", text: "could not load the run: " + err.message }));
      return;
    }
    window.addEventListener("hashchange", () => render(true));
    await render(true);
    root.dataset.ready = "1";
  }
  start();
})();
