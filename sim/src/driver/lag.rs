//! The event loop's driver lag (I12, `Fault::Lag`): due `Tick`s a lagging driver holds back
//! behind a batch of inputs and releases late (moved out of `driver/mod.rs` unchanged, issue
//! 17 item 3).

use super::*;

/// A stretch of driver lag on one process (`Fault::Lag`).
#[derive(Debug, Clone, Copy)]
pub(super) struct LagWindow {
    pub(super) until: Micros,
    pub(super) max_delay: Micros,
    pub(super) max_inputs: u32,
}

/// A due `Tick` a lagging driver holds back: released after `inputs_left` more inputs or at
/// `release_at`, whichever comes first.
#[derive(Debug, Clone, Copy)]
pub(super) struct Hold {
    pub(super) inputs_left: u32,
    pub(super) release_at: Micros,
    pub(super) gen: u64,
}

impl Sim {
    // ---- driver lag (I12) ----------------------------------------------------------------

    /// A due `Tick` for `slot` (0: the mill, i + 1: executor i): a lagging driver holds it
    /// back behind a batch of inputs, as the node's drivers do (they take up to 1–2k inputs
    /// before a `Tick`). Returns whether it is held.
    pub(super) fn hold_tick(&mut self, slot: usize) -> bool {
        let now = self.w.now;
        if self.held[slot].is_some() {
            return true;
        }
        let Some(lag) = self.lag[slot].filter(|l| now < l.until) else {
            return false;
        };
        let inputs_left = self.lag_rng.range(1, u64::from(lag.max_inputs.max(1))) as u32;
        let delay = self.lag_rng.range(MS, lag.max_delay.max(MS));
        self.hold_gen += 1;
        let gen = self.hold_gen;
        let release_at = now + delay;
        self.held[slot] = Some(Hold {
            inputs_left,
            release_at,
            gen,
        });
        self.at(release_at, Ev::LagRelease { slot, gen });
        true
    }

    /// One more input reached the process of `slot`: a held `Tick` whose batch is complete
    /// is released right after this step (an event at the same instant, so the step's
    /// caller still sees its own outputs).
    pub(super) fn count_held_input(&mut self, slot: usize) {
        let now = self.w.now;
        let Some(h) = self.held[slot].as_mut() else {
            return;
        };
        if h.inputs_left == 0 {
            return; // released already, waiting for its event
        }
        h.inputs_left -= 1;
        if h.inputs_left == 0 {
            h.release_at = now;
            let gen = h.gen;
            self.at(now, Ev::LagRelease { slot, gen });
        }
    }

    /// The lagging driver of `slot` gets to its `Tick`: handled if still due (the node's
    /// drivers check `next_deadline() <= now` too), counted when late.
    pub(super) fn release_tick(&mut self, slot: usize) {
        let now = self.w.now;
        self.held[slot] = None;
        let deadline = if slot == 0 {
            self.w.mill.as_ref().and_then(|m| m.next_deadline())
        } else {
            self.w.execs[slot - 1]
                .exec
                .as_ref()
                .and_then(|x| x.next_deadline())
        };
        let Some(d) = deadline.map(|d| d.as_micros()) else {
            return;
        };
        if d > now {
            // Handled meanwhile (an executor runs due timers before any input).
            if slot == 0 {
                self.schedule_mill_tick();
            } else {
                self.schedule_exec_tick(slot - 1);
            }
            return;
        }
        let late = now - d;
        if late > 0 {
            self.stats.late_ticks += 1;
            self.stats.max_tick_lateness = self.stats.max_tick_lateness.max(late);
            self.cov.hit(Path::LateTick);
        }
        if slot == 0 {
            self.mill_input(MillInput::Tick);
        } else {
            self.exec_input(slot - 1, ExecutorInput::Tick);
        }
    }
}
