//! The simulated network: connection-oriented like TCP. Each connection joins one executor to
//! the mill and has two directions, each a FIFO of packets with sampled latency (and a tail).
//! A blocked direction (partition, clog) holds its packets, in order, until it clears — the
//! stalled connection then breaks only when a side's silence timeout closes it. Resets drop
//! everything queued. The network model knows nothing of jobs or leases: faults are data.

use std::collections::{BTreeMap, VecDeque};

use millrace_core::codec::FrameDecoder;
use millrace_core::wire::{ToExecutor, ToMill};
use millrace_core::ConnId;

use crate::rng::Rng;
use crate::scenario::{Micros, MS};

/// A message in flight: a value, or the bytes of an encoded frame.
#[derive(Debug)]
pub enum Payload {
    /// Executor → mill, as a value.
    ToMill(ToMill),
    /// Mill → executor, as a value.
    ToExec(ToExecutor),
    /// An encoded frame (length prefix and postcard body) of either direction.
    Frame(Vec<u8>),
}

/// What travels in one direction of a connection.
#[derive(Debug)]
pub enum Packet {
    /// The executor opens the connection (exec → mill).
    Syn,
    /// The mill accepted (mill → exec).
    Accept,
    /// Nobody listens at the mill's address (mill → exec).
    Refuse,
    /// A message.
    Msg(Payload),
    /// The sender closed its end; after everything sent before.
    Fin,
}

/// One direction of a connection.
#[derive(Debug, Default)]
pub struct Dir {
    /// Packets with the time each may be delivered, in send order.
    pub queue: VecDeque<(Micros, Packet)>,
    /// Delivery time of the last packet queued (FIFO: no packet overtakes it).
    pub last: Micros,
    /// When a delivery event is scheduled, if one is.
    pub pump_at: Option<Micros>,
    /// The receiver's frame decoder, for encoded payloads.
    pub decoder: FrameDecoder,
}

/// One connection between executor `exec` and the mill.
#[derive(Debug)]
pub struct Conn {
    /// The executor.
    pub exec: usize,
    /// The executor's incarnation that opened it.
    pub exec_inc: u32,
    /// The mill's incarnation that accepted it (0 until accepted).
    pub mill_inc: u32,
    /// The mill address the executor dialed (`Connect{mill}`, DESIGN §10).
    pub addr: usize,
    /// Executor → mill.
    pub up: Dir,
    /// Mill → executor.
    pub down: Dir,
    /// The mill side has it open (accepted, not closed or disconnected).
    pub mill_open: bool,
    /// The executor side has it open (connected, not closed or disconnected).
    pub exec_open: bool,
    /// The executor may still receive `Accept`/`Refuse` for it.
    pub exec_waiting: bool,
    /// Reset: nothing more is delivered.
    pub reset: bool,
}

/// Directions that are blocked now, per executor link.
#[derive(Debug, Default, Clone)]
pub struct Blocks {
    /// Blocks on executor → mill, per executor (counts, so faults may overlap).
    pub up: Vec<u32>,
    /// Blocks on mill → executor, per executor.
    pub down: Vec<u32>,
}

/// The network.
#[derive(Debug)]
pub struct Net {
    /// Open (or closing) connections.
    pub conns: BTreeMap<ConnId, Conn>,
    next: u64,
    /// Blocked directions.
    pub blocks: Blocks,
    /// Latency added by spikes in force.
    pub spike: Micros,
    rng: Rng,
    /// Messages sent.
    pub sent: u64,
    /// Every packet takes exactly this long, when set (placement-quality runs).
    pub fixed_latency: Option<Micros>,
}

impl Net {
    /// A network for `executors` executors drawing latencies from `rng`.
    pub fn new(executors: usize, rng: Rng) -> Self {
        Net {
            conns: BTreeMap::new(),
            next: 1,
            blocks: Blocks {
                up: vec![0; executors],
                down: vec![0; executors],
            },
            spike: 0,
            rng,
            sent: 0,
            fixed_latency: None,
        }
    }

    /// A new connection from `exec`; its `Syn` is queued at `now`. Returns the id and when to
    /// pump its up direction.
    pub fn open(
        &mut self,
        now: Micros,
        exec: usize,
        exec_inc: u32,
        addr: usize,
    ) -> (ConnId, Micros) {
        let id = ConnId(self.next);
        self.next += 1;
        let conn = Conn {
            exec,
            exec_inc,
            mill_inc: 0,
            addr,
            up: Dir::default(),
            down: Dir::default(),
            mill_open: false,
            exec_open: false,
            exec_waiting: true,
            reset: false,
        };
        self.conns.insert(id, conn);
        let at = self.push(now, id, true, Packet::Syn);
        (id, at.unwrap_or(now))
    }

    /// One latency sample: a base of 0.1–1 ms, a 1% tail up to 150 ms, plus spikes.
    pub fn latency(&mut self) -> Micros {
        if let Some(fixed) = self.fixed_latency {
            return fixed + self.spike;
        }
        let base = self.rng.range(100, MS);
        let tail = if self.rng.chance(0.01) {
            self.rng.range(5 * MS, 150 * MS)
        } else {
            0
        };
        base + tail + self.spike
    }

    /// Queues `packet` on `conn` (`up`: executor → mill). Returns when to schedule a pump if
    /// the direction has none scheduled.
    pub fn push(&mut self, now: Micros, conn: ConnId, up: bool, packet: Packet) -> Option<Micros> {
        let lat = self.latency();
        let c = self.conns.get_mut(&conn)?;
        if c.reset {
            return None;
        }
        self.sent += 1;
        let d = if up { &mut c.up } else { &mut c.down };
        let at = (now + lat).max(d.last);
        d.last = at;
        d.queue.push_back((at, packet));
        if d.pump_at.is_none() {
            d.pump_at = Some(at);
            return Some(at);
        }
        None
    }

    /// Whether a direction of `exec`'s link is blocked now.
    pub fn blocked(&self, exec: usize, up: bool) -> bool {
        let b = if up {
            &self.blocks.up
        } else {
            &self.blocks.down
        };
        b.get(exec).copied().unwrap_or(0) > 0
    }

    /// Removes a connection both of whose ends are done.
    pub fn reap(&mut self, conn: ConnId) {
        let done = self.conns.get(&conn).is_some_and(|c| {
            !c.mill_open
                && !c.exec_open
                && !c.exec_waiting
                && (c.reset || (c.up.queue.is_empty() && c.down.queue.is_empty()))
        });
        if done {
            self.conns.remove(&conn);
        }
    }
}
