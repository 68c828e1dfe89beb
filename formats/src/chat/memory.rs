//! A memory and time bound for chat-template rendering. Fuel bounds a template's
//! instructions and the output writer its text, but neither sees the strings a template
//! builds in variables, nor the cost of one instruction (a concatenation copies its whole
//! left side, so appending in a loop is quadratic):
//! `{% set ns.s = ns.s ~ ns.s %}` in a loop of 64 (or the same through macro recursion)
//! asks for 2⁶⁴ bytes in a few hundred instructions, and minijinja has no limit of its own
//! for string concatenation. The process would abort on the failed allocation.
//!
//! [`GuardedAlloc`] is a global allocator (the system allocator plus a per-thread count of
//! live bytes); a program installs it with `#[global_allocator]` (the `kiln` binary does).
//! [`bounded`] then runs a render on a thread of its own whose live bytes may not pass a
//! budget and whose time may not pass a deadline: the allocation that would pass the budget
//! wakes the caller, which returns a typed error, and the render thread stops for good
//! right there (it parks; it never returns into the template, and its memory — at most the
//! budget — stays with it); past the deadline the caller returns an error and the thread
//! stops the same way at its next allocation (every step of a template that keeps working
//! allocates). Without the allocator installed, `bounded` runs the render in place and
//! only fuel and the output limit apply.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// The system allocator, counting the live bytes of each thread that runs a bounded render.
pub struct GuardedAlloc;

static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Live bytes this thread allocated (minus what it freed) while bounded, and its budget;
    /// `usize::MAX` when unbounded.
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static BUDGET: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The render's rendezvous with its caller (set while bounded).
    static WAKE: Cell<*const Rendezvous> = const { Cell::new(std::ptr::null()) };
}

struct Rendezvous {
    state: Mutex<State>,
    ready: Condvar,
    /// Set by the caller at the deadline: the render stops at its next allocation.
    cancelled: AtomicBool,
}

enum State {
    Running,
    Done(Result<String, kiln_core::Error>),
    OverBudget(usize),
}

/// Notes that this allocator serves the process. Read first: a store on every allocation
/// would bounce the flag's cache line between all allocating threads.
#[inline]
fn mark_installed() {
    if !INSTALLED.load(Ordering::Relaxed) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
}

/// Counts `grow` more bytes for this thread; past its budget, the render is over.
fn charge(grow: usize) {
    let _ = BUDGET.try_with(|budget| {
        let budget = budget.get();
        if budget == usize::MAX {
            return;
        }
        let _ = LIVE.try_with(|live| {
            let now = live.get().saturating_add(grow);
            live.set(now);
            if now > budget {
                over_budget(Some(now));
            }
        });
        let wake = WAKE.try_with(|w| w.get()).unwrap_or(std::ptr::null());
        // SAFETY: see `over_budget`: the rendezvous outlives this bounded thread.
        if !wake.is_null() && unsafe { &*wake }.cancelled.load(Ordering::Relaxed) {
            over_budget(None);
        }
    });
}

fn release(shrink: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(shrink)));
}

/// Tells the caller, then parks this thread for good. Nothing here allocates: the mutex
/// and condition variable are futex-based, parking allocates nothing.
#[cold]
fn over_budget(live: Option<usize>) -> ! {
    // Unbounded from here on, so nothing below recurses into this path.
    let _ = BUDGET.try_with(|b| b.set(usize::MAX));
    let wake = WAKE.try_with(|w| w.get()).unwrap_or(std::ptr::null());
    if !wake.is_null() {
        // SAFETY: `bounded` keeps the rendezvous alive (an Arc clone moved into this thread)
        // for as long as this thread exists, and this thread never returns from here.
        let r = unsafe { &*wake };
        if let Some(live) = live {
            let mut state = r.state.lock().unwrap_or_else(|p| p.into_inner());
            *state = State::OverBudget(live);
            r.ready.notify_all();
        }
    }
    loop {
        std::thread::park();
    }
}

// SAFETY: every call forwards to the system allocator with the same layout and pointer;
// the bookkeeping around it only reads and writes this thread's counters (no allocation).
unsafe impl GlobalAlloc for GuardedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        mark_installed();
        charge(layout.size());
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        mark_installed();
        charge(layout.size());
        // SAFETY: forwarded unchanged.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        release(layout.size());
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            charge(new_size - layout.size());
        } else {
            release(layout.size() - new_size);
        }
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Whether [`GuardedAlloc`] is the process's allocator (it has served an allocation).
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// A render stopped at a bound; the thread it ran on stays parked with its memory.
#[derive(Debug)]
pub struct LimitHit(pub kiln_core::Error);

/// Runs `render` with at most `budget` live bytes for at most `deadline` when
/// [`GuardedAlloc`] is installed (on a thread of its own; see the module doc), else in
/// place. `Err(LimitHit)` (a `Tokenizer` error naming the limit) past either bound;
/// `Ok(render's own result)` otherwise.
pub fn bounded(
    budget: usize,
    deadline: std::time::Duration,
    render: impl FnOnce() -> Result<String, kiln_core::Error> + Send + 'static,
) -> Result<Result<String, kiln_core::Error>, LimitHit> {
    if !installed() {
        return Ok(render());
    }
    let rendezvous = Arc::new(Rendezvous {
        state: Mutex::new(State::Running),
        ready: Condvar::new(),
        cancelled: AtomicBool::new(false),
    });
    let theirs = rendezvous.clone();
    // A deep stack: a template may nest up to the recursion limit, and each level is a few
    // interpreter frames (a main thread's 8 MiB, not a spawned thread's default 2 MiB).
    let spawned = std::thread::Builder::new()
        .name("kiln-chat-template".into())
        .stack_size(16 << 20)
        .spawn(move || {
            let _ = WAKE.try_with(|w| w.set(Arc::as_ptr(&theirs)));
            let _ = LIVE.try_with(|l| l.set(0));
            let _ = BUDGET.try_with(|b| b.set(budget));
            let result = render();
            let _ = BUDGET.try_with(|b| b.set(usize::MAX));
            let _ = WAKE.try_with(|w| w.set(std::ptr::null()));
            let mut state = theirs.state.lock().unwrap_or_else(|p| p.into_inner());
            *state = State::Done(result);
            theirs.ready.notify_all();
        });
    if let Err(e) = spawned {
        return Ok(Err(kiln_core::Error::Tokenizer(format!(
            "chat template: cannot start its render thread: {e}"
        ))));
    }
    let until = std::time::Instant::now() + deadline;
    let mut state = rendezvous.state.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        match std::mem::replace(&mut *state, State::Running) {
            State::Running => {
                let left = until.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    rendezvous.cancelled.store(true, Ordering::Relaxed);
                    return Err(LimitHit(kiln_core::Error::Tokenizer(format!(
                        "chat template: the render ran for more than {deadline:?} (the limit for one render); the template does too much work"
                    ))));
                }
                state = rendezvous.ready.wait_timeout(state, left).unwrap_or_else(|p| p.into_inner()).0;
            }
            State::Done(result) => return Ok(result),
            State::OverBudget(live) => {
                return Err(LimitHit(kiln_core::Error::Tokenizer(format!(
                    "chat template: the render holds more than {budget} bytes of memory ({live} asked for; the limit for one render); the template builds too much text"
                ))))
            }
        }
    }
}
