//! The event loop's transport: connections between the processes over `crate::net`, packets
//! pumped, held, delivered and reset (moved out of `driver/mod.rs` unchanged, issue 17 item 3).

use super::*;

impl Sim {
    // ---- the network ---------------------------------------------------------------------

    pub(super) fn pump(&mut self, conn: ConnId, up: bool) {
        let now = self.w.now;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        let exec = c.exec;
        let d = if up { &mut c.up } else { &mut c.down };
        if d.pump_at != Some(now) {
            return; // stale
        }
        d.pump_at = None;
        if c.reset {
            return;
        }
        let blocked = {
            let b = if up {
                &self.w.net.blocks.up
            } else {
                &self.w.net.blocks.down
            };
            b[exec] > 0
        };
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        let d = if up { &mut c.up } else { &mut c.down };
        if blocked {
            return; // held until the block clears (repump)
        }
        let Some((at, _)) = d.queue.front() else {
            return;
        };
        if *at > now {
            let at = *at;
            d.pump_at = Some(at);
            self.at(at, Ev::Pump { conn, up });
            return;
        }
        let Some((_, packet)) = d.queue.pop_front() else {
            return;
        };
        if let Some((next, _)) = d.queue.front() {
            let next = (*next).max(now);
            d.pump_at = Some(next);
            self.at(next, Ev::Pump { conn, up });
        }
        if up {
            self.deliver_up(conn, packet);
        } else {
            self.deliver_down(conn, packet);
        }
        self.w.net.reap(conn);
    }

    /// Schedules deliveries held by blocks that no longer apply, for executors `which`.
    pub(super) fn repump(&mut self, which: impl Fn(usize) -> bool) {
        let now = self.w.now;
        let mut todo = Vec::new();
        for (id, c) in self.w.net.conns.iter_mut() {
            if !which(c.exec) || c.reset {
                continue;
            }
            for (up, d) in [(true, &mut c.up), (false, &mut c.down)] {
                if d.pump_at.is_none() {
                    if let Some((at, _)) = d.queue.front() {
                        let at = (*at).max(now);
                        d.pump_at = Some(at);
                        todo.push((at, *id, up));
                    }
                }
            }
        }
        for (at, conn, up) in todo {
            self.at(at, Ev::Pump { conn, up });
        }
    }

    pub(super) fn deliver_up(&mut self, conn: ConnId, packet: Packet) {
        let now = self.w.now;
        let mill_up = self.w.mill.is_some();
        let inc = self.w.mill_inc;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        let exec = c.exec;
        let (addr, conn_inc, conn_open) = (c.addr, c.mill_inc, c.mill_open);
        // DESIGN §10: a deposed mill still holds what it accepted, and its address.
        if self.deposed_conn(conn_inc) && conn_open && !matches!(packet, Packet::Syn) {
            return self.deliver_to_deposed(conn, packet);
        }
        if matches!(packet, Packet::Syn) && self.deposed_syn(conn, addr) {
            return;
        }
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        match packet {
            Packet::Syn if addr != self.w.leader_addr => {
                // A standby listens there and takes no executor (it would answer `Hello`
                // with `Refused{leader}`, E13 tests that in core).
                if let Some(at) = self.w.net.push(now, conn, false, Packet::Refuse) {
                    self.at(at, Ev::Pump { conn, up: false });
                }
            }
            Packet::Syn => {
                if mill_up {
                    c.mill_open = true;
                    c.mill_inc = inc;
                    self.watch.mill_connected(inc, now, &mut self.cov);
                    if let Some(at) = self.w.net.push(now, conn, false, Packet::Accept) {
                        self.at(at, Ev::Pump { conn, up: false });
                    }
                    self.mill_input(MillInput::Connected { conn });
                } else if !self.w.mill_host_down {
                    if let Some(at) = self.w.net.push(now, conn, false, Packet::Refuse) {
                        self.at(at, Ev::Pump { conn, up: false });
                    }
                }
            }
            Packet::Msg(payload) => {
                // What the misbehaving executor's filter said of this message (I8 counts it).
                let tag = self.w.execs[exec]
                    .byz
                    .as_mut()
                    .and_then(|b| b.delivered(conn));
                if !(c.mill_open && mill_up && c.mill_inc == inc) {
                    return;
                }
                let msg = match decode_up(c, payload) {
                    Ok(Some(m)) => m,
                    Ok(None) => return,
                    Err(e) => return self.violate(e),
                };
                self.last_up.insert(conn, now);
                let mut near_grace = None;
                match &msg {
                    ToMill::EventBatch { epoch, events } => {
                        self.ctx.kind = StepKind::Batch {
                            exec,
                            epoch: *epoch,
                        };
                        self.ctx.events.clear();
                        self.ctx.events.extend(events.iter().map(EventSummary::of));
                        if self.grace_left(exec).is_some() {
                            let node = self.w.execs[exec].node.clone();
                            near_grace = self
                                .w
                                .mill
                                .as_ref()
                                .map(|m| (node.clone(), *epoch, m.cursor(&node, *epoch)));
                        }
                    }
                    ToMill::Snapshot { active_leases, .. } => {
                        self.w.snapshot_delivered[exec] = Some((conn, now));
                        self.ctx.kind = StepKind::Snapshot { exec };
                        self.ctx.active.clear();
                        self.ctx.active.extend_from_slice(active_leases);
                        let fence = dur(self.w.mill_cfg.retry_fence);
                        self.c.snapshot_received(now, active_leases, fence);
                        self.note_lost_commits(exec, active_leases);
                    }
                    ToMill::CommitResult {
                        committed: false, ..
                    } => {
                        // The reservation ran out before its commit arrived, on a live
                        // connection (M17: the job is placed again).
                        self.ctx.kind = StepKind::Other;
                        if self.w.execs[exec].honest() {
                            self.cov.hit(Path::CommitRefusedOnLiveSession);
                        }
                    }
                    ToMill::ReserveResult {
                        lease,
                        accepted: true,
                        resources,
                        ..
                    } => {
                        self.ctx.kind = StepKind::Other;
                        let (lease, resources) = (*lease, resources.clone());
                        self.note_charge(lease, &resources);
                    }
                    _ => self.ctx.kind = StepKind::Other,
                }
                self.rival = match &msg {
                    ToMill::Hello { .. } => self.live_rival(conn).map(|(c, at)| (conn, c, at)),
                    _ => None,
                };
                if let Some(tag) = tag {
                    if let Some(path) = self.c.byz_received(&self.w, exec, conn, &msg, tag) {
                        self.cov.hit(path);
                    }
                }
                self.mill_input(MillInput::Message { conn, msg });
                self.rival = None;
                let r = self.c.byz_step_done(&self.w);
                self.check(r);
                if let Some((node, epoch, before)) = near_grace {
                    let after = self.w.mill.as_ref().map(|m| m.cursor(&node, epoch));
                    if after.is_some_and(|a| a > before) {
                        self.cov.hit(Path::EventNearGraceExpiry);
                    }
                }
            }
            Packet::Fin => {
                if c.mill_open && c.mill_inc == inc {
                    c.mill_open = false;
                    self.mill_input(MillInput::Disconnected { conn });
                }
            }
            Packet::Accept | Packet::Refuse => {}
        }
    }

    /// What a deposed mill's connection delivers to it.
    pub(super) fn deliver_to_deposed(&mut self, conn: ConnId, packet: Packet) {
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        match packet {
            Packet::Msg(payload) => {
                let msg = match decode_up(c, payload) {
                    Ok(Some(m)) => m,
                    Ok(None) => return,
                    Err(e) => return self.violate(e),
                };
                self.deposed_input(MillInput::Message { conn, msg });
            }
            Packet::Fin => {
                c.mill_open = false;
                self.deposed_input(MillInput::Disconnected { conn });
            }
            Packet::Syn | Packet::Accept | Packet::Refuse => {}
        }
    }

    pub(super) fn deliver_down(&mut self, conn: ConnId, packet: Packet) {
        let now = self.w.now;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        let exec = c.exec;
        let p = &self.w.execs[exec];
        let alive = p.exec.is_some() && p.inc == c.exec_inc;
        match packet {
            Packet::Accept => {
                if c.exec_waiting && alive && p.connecting == Some(conn) {
                    c.exec_waiting = false;
                    c.exec_open = true;
                    self.w.execs[exec].connecting = None;
                    self.watch.exec_connected(exec, now, &mut self.cov);
                    self.exec_input(exec, ExecutorInput::Connected { conn });
                } else if c.exec_waiting || !c.exec_open {
                    // Nobody waits for it: the executor's host resets it.
                    c.exec_waiting = false;
                    if c.mill_open {
                        if let Some(at) = self.w.net.push(now, conn, true, Packet::Fin) {
                            self.at(at, Ev::Pump { conn, up: true });
                        }
                    }
                }
            }
            Packet::Refuse => {
                c.exec_waiting = false;
                if alive && p.connecting == Some(conn) {
                    self.w.execs[exec].connecting = None;
                    self.exec_input(exec, ExecutorInput::ConnectFailed);
                }
            }
            Packet::Msg(payload) => {
                if !(c.exec_open && alive) {
                    return;
                }
                let msg = match payload {
                    Payload::ToExec(m) => m,
                    Payload::Frame(bytes) => {
                        c.down.decoder.push(&bytes);
                        match c.down.decoder.next_frame::<ToExecutor>() {
                            Ok(Some(m)) => m,
                            other => {
                                self.violate(Violation {
                                    rule: "codec",
                                    message: format!(
                                        "frame to x{exec} on {conn} did not decode: {other:?}"
                                    ),
                                });
                                return;
                            }
                        }
                    }
                    Payload::ToMill(_) => return,
                };
                // M35, E2: an executor that charges more than the standard charge (M14)
                // refuses a direct ask, whose commit follows without waiting for the answer;
                // that commit then finds no reservation and starts nothing (E4).
                if let ToExecutor::ReserveSeat {
                    lease,
                    direct: true,
                    ..
                } = &msg
                {
                    if let Some((name, amount)) = self.w.execs[exec].spec.extra_charge.clone() {
                        let refusal = ToMill::ReserveResult {
                            lease: *lease,
                            accepted: false,
                            reject: Some(RejectKind::Transient),
                            reason: format!(
                                "charge: this executor charges {name} {amount} on top of the standard charge a direct ask needs"
                            ),
                            resources: Default::default(),
                        };
                        self.exec_output(exec, ExecutorOutput::Send { conn, msg: refusal });
                        return;
                    }
                }
                if let Some(b) = self.w.execs[exec].byz.as_mut() {
                    b.incoming(now, conn, &msg, &mut self.byz);
                }
                self.exec_input(exec, ExecutorInput::Message { conn, msg });
            }
            Packet::Fin => {
                if c.exec_open && alive {
                    c.exec_open = false;
                    self.exec_input(exec, ExecutorInput::Disconnected { conn });
                } else {
                    c.exec_open = false;
                }
            }
            Packet::Syn => {}
        }
    }

    /// The executor gave up on a connect: its end is gone; the mill end (if the SYN got
    /// there) sees a FIN.
    pub(super) fn abandon(&mut self, conn: ConnId) {
        let now = self.w.now;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        c.exec_waiting = false;
        c.exec_open = false;
        if let Some(at) = self.w.net.push(now, conn, true, Packet::Fin) {
            self.at(at, Ev::Pump { conn, up: true });
        }
    }

    pub(super) fn reset_notify(&mut self, conn: ConnId, to_mill: bool) {
        let inc = self.w.mill_inc;
        let Some(c) = self.w.net.conns.get_mut(&conn) else {
            return;
        };
        if to_mill {
            let deposed = self.w.deposed.as_ref().is_some_and(|d| d.inc == c.mill_inc);
            if c.mill_open && deposed {
                c.mill_open = false;
                self.deposed_input(MillInput::Disconnected { conn });
            } else if c.mill_open && c.mill_inc == inc && self.w.mill.is_some() {
                c.mill_open = false;
                self.mill_input(MillInput::Disconnected { conn });
            } else {
                c.mill_open = false;
            }
        } else {
            let exec = c.exec;
            let alive = self.w.execs[exec].exec.is_some() && self.w.execs[exec].inc == c.exec_inc;
            if c.exec_open {
                c.exec_open = false;
                if alive {
                    self.exec_input(exec, ExecutorInput::Disconnected { conn });
                }
            } else if c.exec_waiting {
                c.exec_waiting = false;
                if alive && self.w.execs[exec].connecting == Some(conn) {
                    self.w.execs[exec].connecting = None;
                    self.exec_input(exec, ExecutorInput::ConnectFailed);
                }
            }
        }
        self.w.net.reap(conn);
    }
}
