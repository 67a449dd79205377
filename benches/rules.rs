//! Rule evaluation benchmark (issue 5): what deciding costs per event, with a small rule set and
//! with 1,000 rules, against the fixed cost of building the rule context.
//!
//! ```text
//! cargo bench --bench rules                 # full run: 5 rounds x 1 s per case
//! cargo bench --bench rules -- --quick      # smoke run (CI): 1 round x 0.1 s
//! ```
//!
//! Evaluation is pure (event + state + clock in, decisions out), so this runs in one thread with
//! no network and no store: each case calls `Decide::decide` in a loop on the same event and
//! state and reports nanoseconds per event. Cases alternate within a round so machine noise shows
//! in every case alike; figures are min / median / max over the rounds.
//!
//! - **context only** (the baseline): `rules::context::build`, the JSON document every evaluation
//!   builds once per event (lookups and templates read it);
//! - **examples**: `rules/examples/*.toml` (the example handoff set) on a user's text message;
//! - **shipped handoff**: the shipped rule set (`rules/*.toml`, 24 rules) on the same message (a
//!   request for a person, at a time outside its business hours: the after-hours rules decide);
//! - **1,000 rules, 1 matches**: 1,000 rules on `bot.message.received`, each with three conditions
//!   (sender, a keyword regex, the handoff phase) and a templated `send_message`; the message
//!   contains only the last rule's keyword, so every rule is evaluated and one renders;
//! - **1,000 rules, other types**: the same 1,000 rules listening to another event type, so the
//!   cost is the type filter alone.

#[allow(dead_code)]
mod common;

use engine::decide::Decide;
use engine::rules::RuleSet;
use engine::state::ConversationState;
use model::webhook::model::Event;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

const NOW: i64 = 1_795_338_000_000;

struct Case {
    name: &'static str,
    /// Decisions one call makes (checked, so a broken case cannot look fast).
    decisions: usize,
    run: Box<dyn Fn() -> usize>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        println!("usage: cargo bench --bench rules -- [--quick] [--rounds N] [--seconds S]");
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let value = |key: &str| {
        args.iter()
            .position(|a| a == key)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let rounds = value("--rounds").map_or(if quick { 1 } else { 5 }, |v| v.max(1.0) as usize);
    let seconds = value("--seconds").unwrap_or(if quick { 0.1 } else { 1.0 });
    if let Err(e) = run(rounds, Duration::from_secs_f64(seconds)) {
        eprintln!("rules bench failed: {e}");
        std::process::exit(1);
    }
}

fn run(rounds: usize, window: Duration) -> Result<(), String> {
    let (event, state) = message("please, an agent (kw999)")?;
    let examples = RuleSet::load_dir(&repo().join("rules/examples")).map_err(|e| e.to_string())?;
    let many = RuleSet::from_sources(&[("many.toml".into(), many_rules("bot.message.received"))])
        .map_err(|e| e.to_string())?;
    let elsewhere = RuleSet::from_sources(&[(
        "many.toml".into(),
        many_rules("bot.conversation.agent_call_connected"),
    )])
    .map_err(|e| e.to_string())?;
    let decide = |set: RuleSet| {
        let (event, state) = (event.clone(), state.clone());
        Box::new(move || set.decide(&event, &state, NOW).len()) as Box<dyn Fn() -> usize>
    };
    let examples_decisions = examples.decide(&event, &state, NOW).len();
    let shipped =
        RuleSet::from_sources(&engine::rules::shipped::sources()).map_err(|e| e.to_string())?;
    let shipped_decisions = shipped.decide(&event, &state, NOW).len();
    let cases = vec![
        Case {
            name: "context only (baseline)",
            decisions: 0,
            run: {
                let (event, state) = (event.clone(), state.clone());
                Box::new(move || {
                    let ctx = engine::rules::context::build(&event, &state, NOW);
                    usize::from(ctx.is_null())
                })
            },
        },
        Case {
            name: "examples (rules/examples)",
            decisions: examples_decisions,
            run: decide(examples),
        },
        Case {
            name: "shipped handoff (rules/*.toml)",
            decisions: shipped_decisions,
            run: decide(shipped),
        },
        Case {
            name: "1,000 rules, 1 matches",
            decisions: 1,
            run: decide(many),
        },
        Case {
            name: "1,000 rules, other types",
            decisions: 0,
            run: decide(elsewhere),
        },
    ];
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for round in 0..rounds {
        let order: Vec<usize> = if round % 2 == 0 {
            (0..cases.len()).collect()
        } else {
            (0..cases.len()).rev().collect()
        };
        for i in order {
            let case = &cases[i];
            let made = (case.run)();
            if made != case.decisions {
                return Err(format!(
                    "{}: {made} decisions, expected {}",
                    case.name, case.decisions
                ));
            }
            let ns = measure(&case.run, window);
            eprintln!(
                "[round {}/{rounds}] {:<28} {:>10.0} ns/event",
                round + 1,
                case.name,
                ns
            );
            results[i].push(ns);
        }
    }
    let report = report(&cases, &results, rounds, window);
    print!("{report}");
    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("rules-bench.md");
    std::fs::write(&out, &report).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("report written to {}", out.display());
    Ok(())
}

/// Mean ns per call over `window` (calls in batches, so the clock is read rarely).
fn measure(run: &dyn Fn() -> usize, window: Duration) -> f64 {
    let started = Instant::now();
    let mut calls = 0u64;
    let mut sink = 0usize;
    while started.elapsed() < window {
        for _ in 0..64 {
            sink = sink.wrapping_add(std::hint::black_box(run()));
        }
        calls += 64;
    }
    std::hint::black_box(sink);
    started.elapsed().as_nanos() as f64 / calls.max(1) as f64
}

fn report(cases: &[Case], results: &[Vec<f64>], rounds: usize, window: Duration) -> String {
    let mut r = String::new();
    let _ = writeln!(r, "## Rule evaluation benchmark\n");
    let _ = writeln!(r, "| machine | |\n|---|---|");
    for (k, v) in common::machine_info(std::path::Path::new(env!("CARGO_TARGET_TMPDIR")), false)
        .into_iter()
        .filter(|(k, _)| !k.contains("disk"))
    {
        let _ = writeln!(r, "| {k} | {v} |");
    }
    let _ = writeln!(
        r,
        "\nCommand: `cargo bench --bench rules` ({rounds} round(s) x {:.1} s per case, alternating), git {}.\n",
        window.as_secs_f64(),
        common::git_head()
    );
    let _ = writeln!(
        r,
        "| case | decisions per event | ns/event (min / median / max) | x baseline (median) |\n|---|---:|---:|---:|"
    );
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        (v[0], v[v.len() / 2], v[v.len() - 1])
    };
    let base = median(&results[0]).1;
    for (case, ns) in cases.iter().zip(results) {
        let (lo, mid, hi) = median(ns);
        let _ = writeln!(
            r,
            "| {} | {} | {lo:.0} / {mid:.0} / {hi:.0} | {:.1} |",
            case.name,
            case.decisions,
            mid / base
        );
    }
    r
}

fn repo() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A user's text message (the shared fixture's event with the given text), and the state after
/// it was folded in.
fn message(text: &str) -> Result<(Event, ConversationState), String> {
    let path = common::fixtures_dir().join("message-received-text.json");
    let mut delivery = common::read_fixture(&path)?;
    delivery["messages"][0]["data"]["message"]["data"]["text"] = text.into();
    let raw = delivery["messages"][0].to_string();
    let event = model::webhook::parse_event(&raw).map_err(|e| e.to_string())?;
    let id = event
        .payload
        .conversation_id()
        .cloned()
        .ok_or("the fixture is not a conversation event")?;
    let mut state = ConversationState::new(id);
    state.apply(&event);
    Ok((event, state))
}

fn many_rules(on: &str) -> String {
    let mut text = String::new();
    for i in 0..1_000 {
        let _ = write!(
            text,
            r#"
[[rule]]
name = "r{i}"
on = ["{on}"]
when = {{ all = [
  {{ field = "sender", equals = "user" }},
  {{ field = "message.data.text", matches = "\\bkw{i}\\b" }},
  {{ not = {{ field = "state.phase", in = ["requested", "connected"] }} }},
] }}
actions = [{{ type = "send_message", text = "rule {i} for {{{{ conversation_id }}}}: {{{{ message.data.text | upper }}}}" }}]
"#
        );
    }
    text
}
