//! Linearizability of one register, checked the way Wing and Gong's algorithm (as Lowe
//! and Porcupine refine it) does: search for an order of the operations that respects
//! real time and the register's semantics, backtracking, with a cache of (operations
//! linearized, state) pairs already explored so each is tried once.
//!
//! An operation whose outcome is unknown (a timeout, a 504) is *optional*: it may take
//! effect at any moment between its invocation and its bound, or never. Its bound is the
//! write deadline warmpath promises, not infinity
//! (docs/decisions/0045-unknown-write-bound.md; what a 504 means:
//! docs/decisions/0036-writes-and-reads.md): a write that takes effect after the deadline
//! its client was given is a violation, which is how defect 2 (a 504'd write applied
//! seconds after the partition healed) is caught.

use std::collections::HashSet;

/// One operation on the register.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RegOp {
    /// Index into the history, for the report.
    pub id: usize,
    pub call: f64,
    /// Latest moment it can take effect (`f64::INFINITY`: any time).
    pub ret: f64,
    pub kind: Kind,
    /// It may never have taken effect.
    pub optional: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A read that saw this value (`None`: the register was absent).
    Read(Option<u64>),
    Write(u64),
}

/// The checker's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Linearizable,
    /// No order exists. `stuck` is the operation (history index) that could not be placed
    /// at the deepest point the search reached, with the value the register held there.
    NotLinearizable {
        stuck: usize,
        state: Option<u64>,
        placed: usize,
    },
    /// The search gave up after `steps` steps.
    Unknown {
        steps: u64,
    },
}

/// Checks `ops` against a register starting at `init`, giving up after `max_steps`.
pub fn check(ops: &[RegOp], init: Option<u64>, max_steps: u64) -> Verdict {
    let n = ops.len();
    if n == 0 {
        return Verdict::Linearizable;
    }
    // Entries: a call and a return per operation, by time; at equal times calls first, so
    // operations that touch are taken as concurrent (the permissive reading of a clock).
    let mut entries: Vec<(f64, bool, usize)> = Vec::with_capacity(2 * n);
    for (i, o) in ops.iter().enumerate() {
        entries.push((o.call, true, i));
        entries.push((o.ret.max(o.call), false, i));
    }
    entries.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)));
    // A doubly linked list over entries 1..=2n, with 0 the head and 2n+1 the end.
    let end = 2 * n + 1;
    let mut next: Vec<usize> = (1..=end + 1).collect();
    let mut prev: Vec<usize> = (0..=end).map(|i| i.saturating_sub(1)).collect();
    let is_call = |e: usize| entries[e - 1].1;
    let op_of = |e: usize| entries[e - 1].2;
    let mut ret_of = vec![0usize; n];
    let mut call_of = vec![0usize; n];
    for e in 1..=2 * n {
        if is_call(e) {
            call_of[op_of(e)] = e;
        } else {
            ret_of[op_of(e)] = e;
        }
    }
    let unlink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, e: usize| {
        let (p, q) = (prev[e], next[e]);
        next[p] = q;
        prev[q] = p;
    };
    let relink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, e: usize| {
        let (p, q) = (prev[e], next[e]);
        next[p] = e;
        prev[q] = e;
    };
    let lift = |next: &mut Vec<usize>, prev: &mut Vec<usize>, op: usize| {
        unlink(next, prev, call_of[op]);
        unlink(next, prev, ret_of[op]);
    };
    let unlift = |next: &mut Vec<usize>, prev: &mut Vec<usize>, op: usize| {
        relink(next, prev, ret_of[op]);
        relink(next, prev, call_of[op]);
    };

    let words = n.div_ceil(64);
    let mut done = vec![0u64; words];
    let set = |b: &mut Vec<u64>, i: usize| b[i / 64] |= 1 << (i % 64);
    let clear = |b: &mut Vec<u64>, i: usize| b[i / 64] &= !(1 << (i % 64));
    let mut cache: HashSet<(Vec<u64>, Option<u64>)> = HashSet::new();
    // (operation, state before it): what to undo when backtracking.
    let mut stack: Vec<(usize, Option<u64>)> = Vec::new();
    let mut state = init;
    let mut entry = next[0];
    let mut steps = 0u64;
    let mut deepest = (0usize, ops[op_of(entry)].id, init);
    while next[0] != end {
        steps += 1;
        if steps > max_steps {
            return Verdict::Unknown { steps };
        }
        let op = op_of(entry);
        let taken = if is_call(entry) {
            // Place it here, if the register allows.
            match ops[op].kind {
                Kind::Read(v) if v == state => Some(state),
                Kind::Read(_) => None,
                Kind::Write(v) => Some(Some(v)),
            }
        } else if ops[op].optional {
            // Its bound passed and it was not placed: it never took effect.
            Some(state)
        } else {
            None
        };
        if let Some(after) = taken {
            set(&mut done, op);
            if cache.insert((done.clone(), after)) {
                stack.push((op, state));
                state = after;
                lift(&mut next, &mut prev, op);
                entry = next[0];
                continue;
            }
            clear(&mut done, op);
        }
        if is_call(entry) {
            entry = next[entry];
            continue;
        }
        // A required operation's return with the operation not placed: undo the last
        // choice and try the next one.
        if stack.len() >= deepest.0 {
            deepest = (stack.len(), ops[op].id, state);
        }
        let Some((last, before)) = stack.pop() else {
            return not_linearizable(deepest);
        };
        state = before;
        clear(&mut done, last);
        unlift(&mut next, &mut prev, last);
        entry = next[call_of[last]];
    }
    Verdict::Linearizable
}

fn not_linearizable((placed, stuck, state): (usize, usize, Option<u64>)) -> Verdict {
    Verdict::NotLinearizable {
        stuck,
        state,
        placed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: usize, call: f64, ret: f64, v: u64) -> RegOp {
        RegOp {
            id,
            call,
            ret,
            kind: Kind::Write(v),
            optional: false,
        }
    }
    fn r(id: usize, call: f64, ret: f64, v: Option<u64>) -> RegOp {
        RegOp {
            id,
            call,
            ret,
            kind: Kind::Read(v),
            optional: false,
        }
    }
    fn maybe(mut o: RegOp) -> RegOp {
        o.optional = true;
        o
    }
    const STEPS: u64 = 1_000_000;

    #[test]
    fn sequential_history_is_linearizable() {
        let h = [
            w(0, 0., 1., 1),
            r(1, 2., 3., Some(1)),
            w(2, 4., 5., 2),
            r(3, 6., 7., Some(2)),
        ];
        assert_eq!(check(&h, None, STEPS), Verdict::Linearizable);
    }

    #[test]
    fn a_stale_read_after_a_completed_write_is_not() {
        let h = [w(0, 0., 1., 1), w(1, 2., 3., 2), r(2, 4., 5., Some(1))];
        let v = check(&h, None, STEPS);
        assert!(
            matches!(v, Verdict::NotLinearizable { stuck: 2, .. }),
            "{v:?}"
        );
    }

    #[test]
    fn concurrent_operations_may_take_either_order() {
        // The read overlaps both writes: it may see either.
        let h = [
            w(0, 0., 10., 1),
            w(1, 1., 9., 2),
            r(2, 2., 8., Some(1)),
            r(3, 11., 12., Some(1)),
        ];
        assert_eq!(check(&h, None, STEPS), Verdict::Linearizable);
        let h = [w(0, 0., 10., 1), r(1, 11., 12., Some(3))];
        assert!(matches!(
            check(&h, None, STEPS),
            Verdict::NotLinearizable { .. }
        ));
    }

    #[test]
    fn reads_must_not_go_back_in_time() {
        // Two sequential reads see 2 then 1 while the writes were concurrent with both.
        let h = [
            w(0, 0., 100., 1),
            w(1, 0., 100., 2),
            r(2, 10., 20., Some(2)),
            r(3, 30., 40., Some(1)),
        ];
        assert_eq!(check(&h, None, STEPS), Verdict::Linearizable);
        let h = [
            w(0, 0., 5., 1),
            w(1, 0., 100., 2),
            r(2, 10., 20., Some(2)),
            r(3, 30., 40., Some(1)),
        ];
        assert!(matches!(
            check(&h, None, STEPS),
            Verdict::NotLinearizable { stuck: 3, .. }
        ));
    }

    #[test]
    fn an_unknown_write_may_take_effect_within_its_bound_or_never() {
        // Never: the read sees the initial value.
        let h = [maybe(w(0, 0., 50., 1)), r(1, 60., 61., Some(0))];
        assert_eq!(check(&h, Some(0), STEPS), Verdict::Linearizable);
        // Within its bound: seen later.
        let h = [
            maybe(w(0, 0., 50., 1)),
            r(1, 10., 11., Some(0)),
            r(2, 60., 61., Some(1)),
        ];
        assert_eq!(check(&h, Some(0), STEPS), Verdict::Linearizable);
        // After its bound: a read missed it after the bound and a later one saw it.
        let h = [
            maybe(w(0, 0., 50., 1)),
            r(1, 60., 61., Some(0)),
            r(2, 70., 71., Some(1)),
        ];
        assert!(matches!(
            check(&h, Some(0), STEPS),
            Verdict::NotLinearizable { .. }
        ));
        // With no bound the same history is fine.
        let h = [
            maybe(w(0, 0., f64::INFINITY, 1)),
            r(1, 60., 61., Some(0)),
            r(2, 70., 71., Some(1)),
        ];
        assert_eq!(check(&h, Some(0), STEPS), Verdict::Linearizable);
    }

    #[test]
    fn a_value_nobody_wrote_is_not_linearizable() {
        let h = [w(0, 0., 1., 1), r(1, 2., 3., Some(7))];
        assert!(matches!(
            check(&h, None, STEPS),
            Verdict::NotLinearizable { .. }
        ));
    }

    #[test]
    fn long_concurrent_histories_finish() {
        // 4 clients, 2,000 operations, reads seeing the last completed write.
        let mut h = Vec::new();
        let mut last = 0;
        for i in 0..500u64 {
            let t = i as f64 * 10.;
            for c in 0..4u64 {
                let id = h.len();
                let v = i * 4 + c + 1;
                if c % 2 == 0 {
                    h.push(w(id, t + c as f64, t + 8., v));
                    last = v;
                } else {
                    h.push(r(
                        id,
                        t + c as f64,
                        t + 9.,
                        Some(if i == 0 { 0 } else { last }),
                    ));
                }
            }
        }
        assert_eq!(check(&h, Some(0), STEPS), Verdict::Linearizable);
    }
}
