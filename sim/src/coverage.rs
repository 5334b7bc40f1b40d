//! Coverage of rare paths (issue 4, item 9): how often each named situation occurred, summed
//! over a fuzz run. A path that stays at zero means the faults never reached it.

use std::fmt;

use millrace_core::mill::RarePath;

/// A named situation the simulator must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// Grace expired while a cancel was pending (M5).
    GraceExpiryWithPendingCancel,
    /// A commit was re-sent (M17).
    CommitResent,
    /// The mill restarted holding running leases (M29).
    MillRestartWithRunningLeases,
    /// A job waited for quota (M15).
    QuotaWait,
    /// A re-bid after a quota wait charged different resources (M15).
    QuotaRebidChangedResources,
    /// A node was quarantined (M28).
    Quarantine,
    /// An untracked cancel was sent (M8).
    UntrackedCancel,
    /// A cancel's teardown deadline passed (M26).
    TeardownDeadline,
    /// A restarted executor's unacked result reached the mill (E6, E9).
    RestartDeliveredUnackedResult,
    /// A reconcile failed a lease the executor no longer had (M8).
    ReconcileFailedLease,
    /// An old epoch's lease failed after a wipe (M5).
    OldEpochLeaseFailed,
    /// The mill crashed between a `Persist` and the outputs after it.
    CrashAfterPersist,
    /// An executor's host crashed with writes that had not waited for the disk (E5: trims
    /// and contact marks), and its store lost them.
    HostCrashLostUnsyncedWrites,
    /// The mill crashed after sending a step's early asks and before that step's `Persist`
    /// was durable (M12): the asks promised nothing, the job may be gone.
    CrashAfterEarlyAsk,
    /// A job timed out (M18).
    JobTimeout,
    /// A submit was refused for `max_pending` (M10).
    TooManyPending,
    /// A job failed with no compatible executor (M13).
    NoCompatibleExecutor,
    /// A job failed for quota (M15).
    QuotaDenied,
    /// A job no lease took ended by its queue timeout (issue 11).
    QueueTimeout,
    /// An executor crashed with jobs running in its engine (E6, M5).
    ExecCrashWithRunningJobs,
    /// The mill crashed holding reserved (published, uncommitted) leases (M16, M29).
    MillCrashWithReservedLeases,
    /// A partition or clog, once in force, blocks the link of an executor whose lease the mill
    /// has published (`Reserved`: `CommitLease` sent or waiting) and not yet seen committed:
    /// the commit (or its answer) is caught by the cut (M16, M17).
    PartitionDuringCommit,
    /// A user cancelled a job whose executor was cut off or down (M5, M26).
    CancelWhilePartitioned,
    /// At least 50 sessions connected to one restarted mill incarnation within 10 s of its
    /// first (M29, M7).
    ReconnectStorm,
    /// An executor connected five times within two minutes (a flapping link, M7, M8).
    FlappingReconnects,
    /// A job with label constraints was reserved while part of the fleet lacked its labels
    /// (M13).
    LabelConstrainedPlacement,
    /// An executor crashed while its link to the mill was blocked and its outbox held a
    /// terminal result the mill had not acknowledged (E5, E6, E9).
    CrashWithResultsBehindCut,
    /// A restarted mill restored published, uncommitted leases and kept them unclaimed
    /// (M29 as revised).
    RestartWithPublishedLeases,
    /// A reconciling snapshot waited for events still in flight (`outbox_high`, M8).
    ReconcileAwaitedEvents,
    /// A driver handled a deadline late: a `Tick` held behind a batch of inputs (I12).
    LateTick,
    /// An executor crashed after receiving a new `CommitLease` and before persisting it
    /// (E4, M8, M29).
    CrashBeforeCommitPersisted,
    /// An executor came back with its epoch but without a job the mill had committed to it,
    /// and its snapshot reached the mill while the mill still held the lease (E1, E4, M8).
    LostCommitKeptEpoch,
    /// A user cancelled a job while its node was disconnected; the mill sent the
    /// `CancelAttempt` once the node was back (M26).
    CancelResentAfterReconnect,
    /// An event batch was applied during recovery within the last fifth of the node's grace,
    /// or past its deadline while the mill's `Tick` was held (M5, M6, I12).
    EventNearGraceExpiry,
    /// A cancelled job whose engine never stopped was ended by the mill's teardown deadline
    /// alone (M26).
    CancelEndedByDeadline,
    /// A re-bid charged a different amount of a resource the job's owner or repo has a quota
    /// limit on (M14, M15).
    ChargeChangeOnLimitedResource,
    /// A misbehaving executor's violating message reached the mill, which owed a closure for
    /// it (I8, M28).
    ViolationReceived,
    /// A snapshot repeating the session's previous seqno reached the mill (M7).
    SnapshotRepeatRefused,
    /// A replay of the event at the mill's cursor reached the mill (M20).
    ReplayAtCursor,
    /// An executor dropped a lease the mill had seen running and came back with its epoch
    /// (M8).
    LeaseDroppedSameEpoch,
    /// The mill closed the session of an executor whose process was hung (connection open,
    /// nothing sent): its own silence check did it, M9.
    HangClosedBySilence,
    /// A `CommitLease` went again, on the same live connection, to an executor whose process
    /// was hung: the first was unanswered within `bid_timeout` (M17).
    HangCommitResent,
    /// A hung executor resumed with a deadline already past: its late timers ran first (E12).
    HangResumedLate,
    /// A mill took over from the store under a higher term, at the other address, while
    /// the one before it was paused or cut from the store (DESIGN §10).
    Takeover,
    /// An executor answered a message of a term below the highest it had seen with `Stale`
    /// and acted on none of it (E13).
    StaleRefused,
    /// A deposed mill stepped down: its write failed (the store is at a higher term), an
    /// executor told it of a higher term, or its renewal failed (DESIGN §10, I13).
    DeposedSteppedDown,
    /// A deposed mill's message reached an executor that had not heard its successor yet
    /// (allowed: the successor judges nothing of that node before its snapshot, §10).
    DeposedMessageDelivered,
    /// A deposed mill refused the `Hello` of an executor that had heard its successor (E13:
    /// the mill's own check, before the executor's).
    DeposedRefusedHello,
    /// The mill closed the session of an executor whose host died for good without a FIN:
    /// only its silence check could (M9).
    LostHostClosedBySilence,
    /// A lease ended "executor lost" on a node whose process had been away since before the
    /// mill's last restart: the restored placeholder session's grace ended it (M29, M5).
    RestoredGraceEndedLeases,
    /// A second process claiming a node id was refused (M2).
    TwinRefused,
    /// A `CommitResult { committed: false }` reached the mill: the executor's reservation ran
    /// out before the commit arrived (M17).
    CommitRefusedOnLiveSession,
    /// A restarted executor re-attached to the supervisor of a job still running (E9, E14).
    AdoptedRunningJob,
    /// A restarted executor collected the exit a supervisor recorded while no executor was
    /// attached (E9, E14).
    AdoptedRecordedExit,
    /// A restarted executor found nothing left of a job its store held: `JobLost` (E9).
    AdoptedNothingLeft,
    /// A supervisor whose executor did not come back within `reconnect_grace` stopped its
    /// job (E14).
    SupervisorFenced,
    /// An executor that came back with a new store told a leftover supervisor to stop its
    /// job at once (E1, E14).
    SupervisorForeignEpochStop,
    /// A job's attempt ended where the executor reported it (or no longer held it) and
    /// its retry policy queued the next attempt at once (M32).
    RetriedAtOnce,
    /// A job's executor was lost and its next attempt waited out the fence (M32, E12).
    RetriedAfterFence,
    /// A job started its second or later attempt (M32).
    RetryStarted,
    /// A snapshot reported a run retried behind a fence; the fence held (M32).
    FencedRunReported,
    /// A job was asked for before an older job of its owner and class with a lower priority
    /// (M33).
    PriorityOvertook,
    /// A job was asked for before an older job of the same class of another owner: M33's
    /// owner order decided, not submit order.
    OwnerOvertook,
    /// A job pinned to a node started there (M34).
    PinnedRan,
    /// An executor with a free seat turned a job down as Transient because a declared
    /// resource it asks for was not free (E2, M34).
    ResourceRefused,
    /// An executor refused a direct ask (M35): its commit started nothing and the job was
    /// bid for.
    DirectRefused,
    /// The mill crashed between a direct ask and its commit (M35): the executor holds a
    /// reservation nobody commits (E3, M29).
    CrashBetweenDirectAskAndCommit,
    /// A queued job was staged on a full node to start on its next free seat (M36, E16).
    Staged,
    /// A staged lease was withdrawn before it started (M36): it ended Released.
    StagedWithdrawn,
}

impl Path {
    /// Every path, in report order.
    pub const ALL: [Path; 69] = [
        Path::GraceExpiryWithPendingCancel,
        Path::CommitResent,
        Path::MillRestartWithRunningLeases,
        Path::QuotaWait,
        Path::QuotaRebidChangedResources,
        Path::Quarantine,
        Path::UntrackedCancel,
        Path::TeardownDeadline,
        Path::RestartDeliveredUnackedResult,
        Path::ReconcileFailedLease,
        Path::OldEpochLeaseFailed,
        Path::CrashAfterPersist,
        Path::CrashAfterEarlyAsk,
        Path::HostCrashLostUnsyncedWrites,
        Path::JobTimeout,
        Path::TooManyPending,
        Path::NoCompatibleExecutor,
        Path::QuotaDenied,
        Path::QueueTimeout,
        Path::ExecCrashWithRunningJobs,
        Path::MillCrashWithReservedLeases,
        Path::PartitionDuringCommit,
        Path::CancelWhilePartitioned,
        Path::ReconnectStorm,
        Path::FlappingReconnects,
        Path::LabelConstrainedPlacement,
        Path::CrashWithResultsBehindCut,
        Path::RestartWithPublishedLeases,
        Path::ReconcileAwaitedEvents,
        Path::LateTick,
        Path::CrashBeforeCommitPersisted,
        Path::LostCommitKeptEpoch,
        Path::CancelResentAfterReconnect,
        Path::EventNearGraceExpiry,
        Path::CancelEndedByDeadline,
        Path::ChargeChangeOnLimitedResource,
        Path::ViolationReceived,
        Path::SnapshotRepeatRefused,
        Path::ReplayAtCursor,
        Path::LeaseDroppedSameEpoch,
        Path::HangClosedBySilence,
        Path::HangCommitResent,
        Path::HangResumedLate,
        Path::Takeover,
        Path::StaleRefused,
        Path::DeposedSteppedDown,
        Path::DeposedMessageDelivered,
        Path::DeposedRefusedHello,
        Path::LostHostClosedBySilence,
        Path::RestoredGraceEndedLeases,
        Path::TwinRefused,
        Path::CommitRefusedOnLiveSession,
        Path::AdoptedRunningJob,
        Path::AdoptedRecordedExit,
        Path::AdoptedNothingLeft,
        Path::SupervisorFenced,
        Path::SupervisorForeignEpochStop,
        Path::RetriedAtOnce,
        Path::RetriedAfterFence,
        Path::RetryStarted,
        Path::FencedRunReported,
        Path::PriorityOvertook,
        Path::OwnerOvertook,
        Path::PinnedRan,
        Path::ResourceRefused,
        Path::DirectRefused,
        Path::CrashBetweenDirectAskAndCommit,
        Path::Staged,
        Path::StagedWithdrawn,
    ];

    /// The paths issues 4, 10 and 12 name; the coverage test requires each to be reached
    /// over the fixed seeds.
    pub const REQUIRED: [Path; 22] = [
        Path::GraceExpiryWithPendingCancel,
        Path::CommitResent,
        Path::MillRestartWithRunningLeases,
        Path::QuotaRebidChangedResources,
        Path::Quarantine,
        Path::UntrackedCancel,
        Path::TeardownDeadline,
        Path::RestartDeliveredUnackedResult,
        Path::RestartWithPublishedLeases,
        Path::ReconcileAwaitedEvents,
        Path::LateTick,
        Path::CrashBeforeCommitPersisted,
        Path::LostCommitKeptEpoch,
        Path::CancelResentAfterReconnect,
        Path::EventNearGraceExpiry,
        Path::CancelEndedByDeadline,
        Path::ChargeChangeOnLimitedResource,
        Path::AdoptedRunningJob,
        Path::AdoptedRecordedExit,
        Path::SupervisorFenced,
        Path::SupervisorForeignEpochStop,
        Path::DirectRefused,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Path::GraceExpiryWithPendingCancel => "grace expiry with a pending cancel",
            Path::CommitResent => "commit re-sent",
            Path::MillRestartWithRunningLeases => "mill restart with running leases",
            Path::QuotaWait => "quota wait",
            Path::QuotaRebidChangedResources => "quota re-bid with changed resources",
            Path::Quarantine => "quarantine",
            Path::UntrackedCancel => "untracked cancel",
            Path::TeardownDeadline => "teardown deadline hit",
            Path::RestartDeliveredUnackedResult => "executor restart delivered an unacked result",
            Path::ReconcileFailedLease => "reconcile failed a lease",
            Path::OldEpochLeaseFailed => "old-epoch lease failed after a wipe",
            Path::CrashAfterPersist => "mill crash between persist and sends",
            Path::CrashAfterEarlyAsk => "mill crash between early asks and their step's persist",
            Path::HostCrashLostUnsyncedWrites => "host crash lost unsynced trims or contact marks",
            Path::JobTimeout => "job timeout",
            Path::TooManyPending => "submit refused: too many pending",
            Path::NoCompatibleExecutor => "no compatible executor",
            Path::QuotaDenied => "quota denied",
            Path::QueueTimeout => "queue timeout",
            Path::ExecCrashWithRunningJobs => "executor crash with running jobs",
            Path::MillCrashWithReservedLeases => "mill crash with reserved leases",
            Path::PartitionDuringCommit => "partition during a commit",
            Path::CancelWhilePartitioned => "cancel while partitioned",
            Path::ReconnectStorm => "reconnect storm (>= 50 sessions) after a mill restart",
            Path::FlappingReconnects => "flapping executor (5 connects in 2 min)",
            Path::LabelConstrainedPlacement => "label-constrained placement",
            Path::CrashWithResultsBehindCut => "executor crash with unacked results behind a cut",
            Path::RestartWithPublishedLeases => "mill restart with published, uncommitted leases",
            Path::ReconcileAwaitedEvents => "reconcile waited for events in flight",
            Path::LateTick => "tick delivered late (driver lag)",
            Path::CrashBeforeCommitPersisted => "executor crash between commit and its persist",
            Path::LostCommitKeptEpoch => "executor lost a committed job, same epoch",
            Path::CancelResentAfterReconnect => "cancel while disconnected, sent after reconnect",
            Path::EventNearGraceExpiry => "event applied in recovery just before grace expiry",
            Path::CancelEndedByDeadline => "cancel ended by deadline, engine never stopped",
            Path::ChargeChangeOnLimitedResource => "re-bid changed a quota-limited charge",
            Path::ViolationReceived => "violating message received (closure owed)",
            Path::SnapshotRepeatRefused => "snapshot repeating its seqno received",
            Path::ReplayAtCursor => "replay of the event at the cursor received",
            Path::LeaseDroppedSameEpoch => "executor dropped a running lease, same epoch",
            Path::HangClosedBySilence => {
                "hung executor's session closed by the mill's silence check"
            }
            Path::HangCommitResent => "commit re-sent to a hung executor on a live session",
            Path::HangResumedLate => "hung executor resumed with late timers",
            Path::Takeover => "a standby took over under a higher term (§10)",
            Path::StaleRefused => "executor refused a stale term (E13)",
            Path::DeposedSteppedDown => "deposed mill stepped down (I13)",
            Path::DeposedMessageDelivered => "deposed mill's message reached an executor",
            Path::DeposedRefusedHello => "deposed mill told of a higher term (E13)",
            Path::LostHostClosedBySilence => "lost host's session closed by silence",
            Path::RestoredGraceEndedLeases => "restarted mill's grace ended an away node's leases",
            Path::TwinRefused => "second process with a live node's id refused",
            Path::CommitRefusedOnLiveSession => "commit refused: the reservation ran out first",
            Path::AdoptedRunningJob => "restart adopted a running job (supervisor)",
            Path::AdoptedRecordedExit => "restart collected an exit recorded while down",
            Path::AdoptedNothingLeft => "restart found a job lost",
            Path::SupervisorFenced => "supervisor stopped its job: no executor within grace",
            Path::SupervisorForeignEpochStop => "supervisor stopped at once by a new store",
            Path::RetriedAtOnce => "retry queued at once (M32)",
            Path::RetriedAfterFence => "retry waited out the fence (M32)",
            Path::RetryStarted => "a later attempt started (M32)",
            Path::FencedRunReported => "fenced run reported alive, fence held (M32)",
            Path::PriorityOvertook => "a higher priority job went before an older one (M33)",
            Path::OwnerOvertook => "an owner with fewer leases went before an older job (M33)",
            Path::PinnedRan => "a pinned job started on its node (M34)",
            Path::ResourceRefused => "a free seat refused: a resource was not free (E2, M34)",
            Path::DirectRefused => "direct ask refused; its commit started nothing (M35)",
            Path::CrashBetweenDirectAskAndCommit => {
                "mill crash between a direct ask and its commit (M35)"
            }
            Path::Staged => "a job was staged on a full node (M36)",
            Path::StagedWithdrawn => "a staged job was withdrawn before it started (M36)",
        }
    }

    /// Its name in scenario files (`expect.reach`).
    pub fn key(self) -> &'static str {
        match self {
            Path::GraceExpiryWithPendingCancel => "grace-expiry-with-pending-cancel",
            Path::CommitResent => "commit-resent",
            Path::MillRestartWithRunningLeases => "mill-restart-with-running-leases",
            Path::QuotaWait => "quota-wait",
            Path::QuotaRebidChangedResources => "quota-rebid-changed-resources",
            Path::Quarantine => "quarantine",
            Path::UntrackedCancel => "untracked-cancel",
            Path::TeardownDeadline => "teardown-deadline",
            Path::RestartDeliveredUnackedResult => "restart-delivered-unacked-result",
            Path::ReconcileFailedLease => "reconcile-failed-lease",
            Path::OldEpochLeaseFailed => "old-epoch-lease-failed",
            Path::CrashAfterPersist => "crash-after-persist",
            Path::CrashAfterEarlyAsk => "crash-after-early-ask",
            Path::HostCrashLostUnsyncedWrites => "host-crash-lost-unsynced-writes",
            Path::JobTimeout => "job-timeout",
            Path::TooManyPending => "too-many-pending",
            Path::NoCompatibleExecutor => "no-compatible-executor",
            Path::QuotaDenied => "quota-denied",
            Path::QueueTimeout => "queue-timeout",
            Path::ExecCrashWithRunningJobs => "exec-crash-with-running-jobs",
            Path::MillCrashWithReservedLeases => "mill-crash-with-reserved-leases",
            Path::PartitionDuringCommit => "partition-during-commit",
            Path::CancelWhilePartitioned => "cancel-while-partitioned",
            Path::ReconnectStorm => "reconnect-storm",
            Path::FlappingReconnects => "flapping-reconnects",
            Path::LabelConstrainedPlacement => "label-constrained-placement",
            Path::CrashWithResultsBehindCut => "crash-with-results-behind-cut",
            Path::RestartWithPublishedLeases => "restart-with-published-leases",
            Path::ReconcileAwaitedEvents => "reconcile-awaited-events",
            Path::LateTick => "late-tick",
            Path::CrashBeforeCommitPersisted => "crash-before-commit-persisted",
            Path::LostCommitKeptEpoch => "lost-commit-kept-epoch",
            Path::CancelResentAfterReconnect => "cancel-resent-after-reconnect",
            Path::EventNearGraceExpiry => "event-near-grace-expiry",
            Path::CancelEndedByDeadline => "cancel-ended-by-deadline",
            Path::ChargeChangeOnLimitedResource => "charge-change-on-limited-resource",
            Path::ViolationReceived => "violation-received",
            Path::SnapshotRepeatRefused => "snapshot-repeat-refused",
            Path::ReplayAtCursor => "replay-at-cursor",
            Path::LeaseDroppedSameEpoch => "lease-dropped-same-epoch",
            Path::HangClosedBySilence => "hang-closed-by-silence",
            Path::HangCommitResent => "hang-commit-resent",
            Path::HangResumedLate => "hang-resumed-late",
            Path::Takeover => "takeover",
            Path::StaleRefused => "stale-refused",
            Path::DeposedSteppedDown => "deposed-stepped-down",
            Path::DeposedMessageDelivered => "deposed-message-delivered",
            Path::DeposedRefusedHello => "deposed-refused-hello",
            Path::LostHostClosedBySilence => "lost-host-closed-by-silence",
            Path::RestoredGraceEndedLeases => "restored-grace-ended-leases",
            Path::TwinRefused => "twin-refused",
            Path::CommitRefusedOnLiveSession => "commit-refused",
            Path::AdoptedRunningJob => "adopted-running-job",
            Path::AdoptedRecordedExit => "adopted-recorded-exit",
            Path::AdoptedNothingLeft => "adopted-nothing-left",
            Path::SupervisorFenced => "supervisor-fenced",
            Path::SupervisorForeignEpochStop => "supervisor-foreign-epoch-stop",
            Path::RetriedAtOnce => "retried-at-once",
            Path::RetriedAfterFence => "retried-after-fence",
            Path::RetryStarted => "retry-started",
            Path::FencedRunReported => "fenced-run-reported",
            Path::PriorityOvertook => "priority-overtook",
            Path::OwnerOvertook => "owner-overtook",
            Path::PinnedRan => "pinned-ran",
            Path::ResourceRefused => "resource-refused",
            Path::DirectRefused => "direct-refused",
            Path::CrashBetweenDirectAskAndCommit => "crash-between-direct-ask-and-commit",
            Path::Staged => "staged",
            Path::StagedWithdrawn => "staged-withdrawn",
        }
    }

    /// The path named `key` in scenario files.
    pub fn from_key(key: &str) -> Option<Path> {
        Path::ALL.into_iter().find(|p| p.key() == key)
    }
}

/// The name of a core rare path, for traces.
pub fn rare_name(p: RarePath) -> &'static str {
    match p {
        RarePath::GraceExpiredWithPendingCancel => "grace-expired-with-pending-cancel",
        RarePath::CommitResent => "commit-resent",
        RarePath::RestartWithRunningLeases => "restart-with-running-leases",
        RarePath::QuotaRebidChangedResources => "quota-rebid-changed-resources",
        RarePath::QuotaWait => "quota-wait",
        RarePath::UntrackedCancel => "untracked-cancel",
        RarePath::TeardownDeadline => "teardown-deadline",
        RarePath::ReconcileFailedLease => "reconcile-failed-lease",
        RarePath::OldEpochLeaseFailed => "old-epoch-lease-failed",
        RarePath::RestartWithPublishedLeases => "restart-with-published-leases",
        RarePath::ReconcileAwaitedEvents => "reconcile-awaited-events",
        RarePath::FencedRunReported => "fenced-run-reported",
        RarePath::DirectRefused => "direct-refused",
        RarePath::Staged => "staged",
        RarePath::StagedWithdrawn => "staged-withdrawn",
    }
}

/// Maps a core observation to a path.
pub fn from_rare(p: RarePath) -> Option<Path> {
    Some(match p {
        RarePath::GraceExpiredWithPendingCancel => Path::GraceExpiryWithPendingCancel,
        RarePath::CommitResent => Path::CommitResent,
        RarePath::RestartWithRunningLeases => Path::MillRestartWithRunningLeases,
        RarePath::QuotaRebidChangedResources => Path::QuotaRebidChangedResources,
        RarePath::QuotaWait => Path::QuotaWait,
        RarePath::UntrackedCancel => Path::UntrackedCancel,
        RarePath::TeardownDeadline => Path::TeardownDeadline,
        RarePath::ReconcileFailedLease => Path::ReconcileFailedLease,
        RarePath::OldEpochLeaseFailed => Path::OldEpochLeaseFailed,
        RarePath::RestartWithPublishedLeases => Path::RestartWithPublishedLeases,
        RarePath::ReconcileAwaitedEvents => Path::ReconcileAwaitedEvents,
        RarePath::FencedRunReported => Path::FencedRunReported,
        RarePath::DirectRefused => Path::DirectRefused,
        RarePath::Staged => Path::Staged,
        RarePath::StagedWithdrawn => Path::StagedWithdrawn,
    })
}

/// Counts per path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Coverage {
    counts: [u64; Path::ALL.len()],
}

impl Default for Coverage {
    fn default() -> Self {
        Coverage {
            counts: [0; Path::ALL.len()],
        }
    }
}

impl Coverage {
    /// Counts one occurrence.
    pub fn hit(&mut self, p: Path) {
        self.counts[p as usize] += 1;
    }

    /// How often `p` occurred.
    pub fn get(&self, p: Path) -> u64 {
        self.counts[p as usize]
    }

    /// Adds another run's counts.
    pub fn add(&mut self, other: &Coverage) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
    }

    /// Required paths never reached.
    pub fn missing(&self) -> Vec<Path> {
        Path::REQUIRED
            .into_iter()
            .filter(|p| self.get(*p) == 0)
            .collect()
    }
}

impl fmt::Display for Coverage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for p in Path::ALL {
            let required = if Path::REQUIRED.contains(&p) {
                "*"
            } else {
                " "
            };
            writeln!(f, "  {required} {:>8}  {}", self.get(p), p.name())?;
        }
        Ok(())
    }
}
