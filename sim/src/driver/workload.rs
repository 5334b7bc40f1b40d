//! The event loop's side of the workload: each drawn arrival (`crate::workload`) submitted by
//! its client, retried while the mill is down, and resubmitted under its idempotency key
//! (M31) (moved out of `driver/mod.rs` unchanged, issue 17 item 3).

use super::*;

impl Sim {
    // ---- the workload --------------------------------------------------------------------

    pub(super) fn arrive(&mut self, k: usize) {
        let now = self.w.now;
        let (_, arrival) = self.w.workload.arrivals[k].clone();
        if self.w.mill.is_none() {
            // The client retries until the mill is back.
            self.at(now + SEC, Ev::Arrive(k));
            return;
        }
        match arrival {
            Arrival::Job { spec, cancel_after } => {
                let timeout = spec.timeout;
                let r = self
                    .mill_submit_keyed(spec, now / MS, Some(arrival_key(k)))
                    .map(|r| r.map(|s| s.job));
                match r {
                    Some(Ok(job)) => {
                        if self.c.inserted(job) {
                            self.times.submitted(job, now);
                            self.w.arrivals_done += 1;
                            self.stats.accepted += 1;
                            self.w.job_of_arrival[k] = Some(job);
                            let r = self.c.accepted(job, k);
                            self.check(r);
                            self.c.timeout_armed(job, now, timeout);
                            if let Some(after) = cancel_after {
                                self.at(now + after, Ev::UserCancel(k));
                            }
                            // Every fourth client retries as if the answer was lost (M31);
                            // by arrival index, so no random stream moves.
                            if k % RESUBMIT_EVERY == 0 {
                                self.at(now + SEC, Ev::Resubmit(k));
                            }
                        } else {
                            // The mill crashed before the insert was durable: no answer
                            // reached the client, which tries again.
                            self.at(now + SEC, Ev::Arrive(k));
                        }
                    }
                    Some(Err(RequestError::TooManyPending { .. })) => {
                        self.w.arrivals_done += 1;
                        self.cov.hit(Path::TooManyPending);
                        if self.step_wrote {
                            self.violate(Violation {
                                rule: "I2",
                                message: "a submit refused for max_pending stored something (M10)"
                                    .into(),
                            });
                        }
                    }
                    Some(Err(e)) => {
                        self.w.arrivals_done += 1;
                        self.violate(Violation {
                            rule: "I2",
                            message: format!("a valid submit was refused: {e}"),
                        });
                    }
                    None => self.at(now + SEC, Ev::Arrive(k)),
                }
            }
            Arrival::Invalid { spec, what } => {
                self.w.arrivals_done += 1;
                let r = self.mill_submit(spec, now / MS);
                let refused = matches!(r, Some(Err(RequestError::Spec(_))));
                if !refused || self.step_outputs > 0 {
                    self.violate(Violation {
                        rule: "I2",
                        message: format!(
                            "an invalid submit ({what}) was not refused cleanly: {r:?}, {} outputs",
                            self.step_outputs
                        ),
                    });
                }
            }
        }
    }

    /// M31: an accepted arrival's client submits it again under the same key; the mill
    /// must answer the same job and store nothing, across mill restarts too.
    pub(super) fn resubmit(&mut self, k: usize) {
        let now = self.w.now;
        let (Some(first), (_, Arrival::Job { spec, .. })) = (
            self.w.job_of_arrival[k],
            self.w.workload.arrivals[k].clone(),
        ) else {
            return;
        };
        if self.w.mill.is_none() {
            self.at(now + SEC, Ev::Resubmit(k));
            return;
        }
        let key = arrival_key(k);
        if let Some(got) = self.mill_submit_keyed(spec, now / MS, Some(key.clone())) {
            self.stats.resubmits += 1;
            let r = self.c.keyed_retry(&key, first, &got, self.step_wrote);
            self.check(r);
        }
    }
}

/// One accepted arrival in this many is submitted again by its client (M31).
const RESUBMIT_EVERY: usize = 4;

/// The idempotency key the client of arrival `k` submits under (M31).
fn arrival_key(k: usize) -> IdempotencyKey {
    // "arrival-" and a decimal index: always 1-256 printable ASCII characters.
    IdempotencyKey::new(format!("arrival-{k}")).unwrap_or_else(|e| unreachable!("{e}"))
}
