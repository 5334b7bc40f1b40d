//! Ids, time and the small value types shared by every part of the protocol.
//!
//! Every id is a newtype so that a lease id can never be passed where a job id is meant.
//! Ids that arrive from the network are validated where they enter (M1 for node ids).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A monotonic instant owned by the driver: microseconds since an origin the driver picks.
///
/// The core never reads a clock; it is handed a `Time` with every input. Durable state holds
/// no `Time` (DESIGN §2), with one exception: the executor's last contact with the mill
/// (E12), which is only meaningful if the driver's origin is the same in every process of
/// one store (the node anchors it to the wall clock).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Time(u64);

impl Time {
    /// The driver's origin.
    pub const ZERO: Time = Time(0);

    /// An instant `micros` microseconds after the origin.
    pub const fn from_micros(micros: u64) -> Self {
        Time(micros)
    }

    /// Microseconds since the origin.
    pub const fn as_micros(self) -> u64 {
        self.0
    }

    /// `self + d`, saturating at the far future instead of overflowing.
    pub fn plus(self, d: Duration) -> Time {
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(micros))
    }

    /// The time from `earlier` to `self`, or zero if `earlier` is later.
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_micros(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Display for Time {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:06}s", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}

/// Why an id or name from outside was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// A node id must be 1–128 characters.
    #[error("node id must be 1-128 characters, got {len}")]
    NodeIdLength {
        /// The length that was given.
        len: usize,
    },
    /// A node id may hold only `[A-Za-z0-9._-]`.
    #[error("node id {id:?} holds {bad:?}; only A-Z a-z 0-9 . _ - are allowed")]
    NodeIdChar {
        /// The id as given (cut to 128 chars).
        id: String,
        /// The first character that is not allowed.
        bad: char,
    },
}

/// The name an executor gives itself (M1): 1–128 characters of `[A-Za-z0-9._-]`.
///
/// A `NodeId` is valid by construction; the wire carries the raw string in `Hello` so that a
/// bad one can be refused with a reason instead of failing to decode.
///
/// The text is shared (`Arc<str>`): the mill keys sessions, cursors, timers, leases and the
/// rank index by node id and copies ids into terminals and job states, so a clone is a
/// reference-count increment rather than an allocation.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(Arc<str>);

impl NodeId {
    /// Longest node id accepted.
    pub const MAX_LEN: usize = 128;

    /// Validates `s` as a node id (M1).
    pub fn new(s: impl Into<String>) -> Result<Self, IdError> {
        let s = s.into();
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err(IdError::NodeIdLength { len: s.len() });
        }
        if let Some(bad) = s
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            let id: String = s.chars().take(Self::MAX_LEN).collect();
            return Err(IdError::NodeIdChar { id, bad });
        }
        Ok(NodeId(Arc::from(s)))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Serialize for NodeId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for NodeId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        NodeId::new(s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! u64_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The raw number.
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

u64_id!(
    /// The id of an executor's durable store (E1): made when the store is created, kept across
    /// restarts, new when the store is wiped. Cursors are kept per (node, epoch).
    Epoch,
    "e"
);
u64_id!(
    /// One attempt to run a job on one executor. Never repeats, across restarts too (M30).
    LeaseId,
    "l"
);
u64_id!(
    /// A job accepted by the mill. Never repeats.
    JobId,
    "j"
);
u64_id!(
    /// The position of an event in one (node, epoch) stream; the first event is 1.
    Seqno,
    "s"
);
u64_id!(
    /// One transport connection, numbered by the driver.
    ConnId,
    "c"
);
u64_id!(
    /// A mill's leadership term (DESIGN §10, E13): taken from the store when a mill starts
    /// leading, higher than every term before it, and carried by every message the mill sends
    /// an executor. An executor keeps the highest it has seen and refuses anything lower, so
    /// a deposed mill (paused past its lease, cut off from the store) cannot act through an
    /// executor that has heard its successor (I13). Term 0 is "none yet".
    Term,
    "t"
);

impl Seqno {
    /// The seqno after this one.
    pub fn next(self) -> Seqno {
        Seqno(self.0.saturating_add(1))
    }
}

/// Resource charges and requests: name → positive amount, ordered by name.
pub type Resources = std::collections::BTreeMap<String, u64>;

/// Largest resource amount (2^53, so that JSON clients keep it exact).
pub const MAX_RESOURCE_AMOUNT: u64 = 1 << 53;
/// The resource every seat charges once (`jobs: 1`), so owner/repo quotas can count jobs
/// (E2).
pub const SEAT_RESOURCE: &str = "jobs";
/// Most resource entries in one request or claim.
pub const MAX_RESOURCES: usize = 32;
/// Longest resource, label or engine name.
pub const MAX_NAME_LEN: usize = 64;

/// Why a resource map was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    /// Too many entries.
    #[error("{count} resources; at most {max} are allowed")]
    TooMany {
        /// Entries given.
        count: usize,
        /// The bound.
        max: usize,
    },
    /// A name is empty, too long or not printable ASCII.
    #[error("resource name {name:?} must be 1-64 printable ASCII characters")]
    BadName {
        /// The name as given (cut).
        name: String,
    },
    /// An amount is zero or too large.
    #[error("resource {name:?} amount {amount} must be 1..=2^53")]
    BadAmount {
        /// The resource.
        name: String,
        /// The amount given.
        amount: u64,
    },
}

/// Checks a name (engine, label, resource): 1–64 printable ASCII characters without spaces.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && name.bytes().all(|b| b.is_ascii_graphic())
}

/// Validates a resource map: ≤ 32 entries, valid names, amounts in 1..=2^53 (M14).
pub fn validate_resources(resources: &Resources) -> Result<(), ResourceError> {
    if resources.len() > MAX_RESOURCES {
        return Err(ResourceError::TooMany {
            count: resources.len(),
            max: MAX_RESOURCES,
        });
    }
    for (name, &amount) in resources {
        if !valid_name(name) {
            return Err(ResourceError::BadName {
                name: name.chars().take(MAX_NAME_LEN).collect(),
            });
        }
        if amount == 0 || amount > MAX_RESOURCE_AMOUNT {
            return Err(ResourceError::BadAmount {
                name: name.clone(),
                amount,
            });
        }
    }
    Ok(())
}

/// Cuts a human-readable reason to `max` bytes on a char boundary (reasons are bounded).
pub fn bounded_reason(reason: impl Into<String>, max: usize) -> String {
    let mut s = reason.into();
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn m1_node_id_accepts_the_allowed_alphabet() {
        assert!(NodeId::new("exec-1.rack_2").is_ok());
        assert!(NodeId::new("a".repeat(128)).is_ok());
    }

    #[test]
    fn m1_node_id_refuses_bad_length_and_chars() {
        assert_eq!(NodeId::new(""), Err(IdError::NodeIdLength { len: 0 }));
        assert_eq!(
            NodeId::new("a".repeat(129)),
            Err(IdError::NodeIdLength { len: 129 })
        );
        assert!(matches!(
            NodeId::new("exec 1"),
            Err(IdError::NodeIdChar { bad: ' ', .. })
        ));
        assert!(matches!(
            NodeId::new("exé"),
            Err(IdError::NodeIdChar { bad: 'é', .. })
        ));
    }

    #[test]
    fn m14_resource_validation_names_the_bad_entry() {
        let mut r = Resources::new();
        r.insert("cpu".into(), 0);
        assert!(matches!(
            validate_resources(&r),
            Err(ResourceError::BadAmount { amount: 0, .. })
        ));
        r.insert("cpu".into(), MAX_RESOURCE_AMOUNT + 1);
        assert!(validate_resources(&r).is_err());
        r.insert("cpu".into(), MAX_RESOURCE_AMOUNT);
        assert!(validate_resources(&r).is_ok());
        r.insert("".into(), 1);
        assert!(matches!(
            validate_resources(&r),
            Err(ResourceError::BadName { .. })
        ));
    }

    #[test]
    fn time_arithmetic_saturates() {
        let t = Time::from_micros(u64::MAX - 1);
        assert_eq!(t.plus(Duration::from_secs(1)), Time::from_micros(u64::MAX));
        assert_eq!(Time::ZERO.since(t), Duration::ZERO);
    }
}
