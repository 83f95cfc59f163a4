#![cfg_attr(not(any(feature = "axum", feature = "actix")), allow(dead_code))]

//! The global budget of buffered bytes ([the contract](crate::design) §5, "Buffers in flight"): request bodies read
//! before the claim and response bodies read to be recorded, across all requests at once.
//!
//! It is charged for bytes that arrived, never for bytes announced: a `Content-Length` reserves
//! nothing, so idle connections announcing large bodies hold no budget.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The bytes buffered now and the bound on them.
#[derive(Debug)]
pub(crate) struct BufferBudget {
    used: AtomicUsize,
    max: usize,
}

impl BufferBudget {
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicUsize::new(0),
            max,
        })
    }

    /// Bytes buffered now, across all permits.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// An empty share of the budget.
    pub(crate) fn permit(self: &Arc<Self>) -> BufferPermit {
        BufferPermit {
            budget: Arc::clone(self),
            bytes: 0,
        }
    }
}

/// A share of the budget, returned when dropped.
#[derive(Debug)]
pub(crate) struct BufferPermit {
    budget: Arc<BufferBudget>,
    bytes: usize,
}

impl BufferPermit {
    /// Takes `more` bytes; `false` (and nothing taken) when that would exceed the bound.
    pub(crate) fn grow(&mut self, more: usize) -> bool {
        let used = &self.budget.used;
        let before = used.fetch_add(more, Ordering::AcqRel);
        if before.saturating_add(more) > self.budget.max {
            used.fetch_sub(more, Ordering::AcqRel);
            return false;
        }
        self.bytes += more;
        true
    }

    /// Takes `more` bytes whatever the bound: for bytes that are already in memory (a sized
    /// response body), which refusing would not free, only leave unrecorded.
    pub(crate) fn charge(&mut self, more: usize) {
        self.budget.used.fetch_add(more, Ordering::AcqRel);
        self.bytes += more;
    }
}

impl Drop for BufferPermit {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_returned_when_permits_drop() {
        let budget = BufferBudget::new(100);
        let mut a = budget.permit();
        assert!(a.grow(60), "within the budget");
        assert!(!budget.permit().grow(60), "over the budget");
        assert!(!a.grow(41), "growing past the budget");
        assert!(a.grow(40));
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 0, "the budget came back");
        assert!(budget.permit().grow(100));
    }

    #[test]
    fn bytes_in_memory_are_charged_past_the_bound_and_returned() {
        let budget = BufferBudget::new(10);
        let mut full = budget.permit();
        assert!(full.grow(10));
        let mut sized = budget.permit();
        sized.charge(500);
        assert_eq!(budget.used(), 510);
        assert!(!budget.permit().grow(1), "nothing else fits while over");
        drop(sized);
        drop(full);
        assert_eq!(budget.used(), 0);
    }
}
