//! Engine configuration and the epoch ticker that enforces deadlines.

use super::{Result, SandboxError};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// Engine-wide sandbox settings.
///
/// ```
/// let config = idem::sandbox::SandboxConfig { pooling: false, ..Default::default() };
/// assert_eq!(config.max_stack, 1 << 20);
/// ```
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// Use the pooling allocator (fast instantiation) instead of on-demand.
    pub pooling: bool,
    /// Instances that can be alive at once (pool size).
    pub max_instances: u32,
    /// Largest memory cap any plugin may be given (pool slot size).
    pub max_memory: usize,
    /// Wasm stack limit for every call.
    pub max_stack: usize,
    /// Enable fuel metering (needed for per-plugin fuel budgets; costs speed).
    pub fuel: bool,
    /// Deadline resolution, and how long a running guest holds its async
    /// worker thread before it yields (see [`super::Sandbox::call`]).
    pub epoch_tick: Duration,
    /// Where precompiled components are cached (`None`: compile every load).
    pub cache_dir: Option<PathBuf>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            pooling: true,
            max_instances: 128,
            max_memory: 1 << 30,
            max_stack: 1 << 20,
            fuel: false,
            epoch_tick: Duration::from_millis(1),
            cache_dir: None,
        }
    }
}

/// Fiber stack beyond the wasm stack limit, for host functions and WASI.
const ASYNC_STACK_HOST_ROOM: usize = 1 << 20;

/// Builds the engine. Keeping memories and tables resident with
/// `pagemap_scan` removes the page faults of a fresh instance's first call
/// (measured: 27 → 9 µs per job, see docs/benchmarks.md).
pub fn build(config: &SandboxConfig) -> Result<Engine> {
    let mut wasm = Config::new();
    wasm.epoch_interruption(true)
        .consume_fuel(config.fuel)
        .max_wasm_stack(config.max_stack)
        // Guests run on fibers: room for the wasm stack and the host calls
        // made from it (the default 2 MiB would refuse a larger max_stack).
        .async_stack_size(config.max_stack + ASYNC_STACK_HOST_ROOM)
        .memory_init_cow(true);
    if config.pooling {
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(config.max_instances)
            .total_core_instances(config.max_instances * 4)
            .total_memories(config.max_instances * 2)
            .total_tables(config.max_instances * 4)
            .total_stacks(config.max_instances)
            .max_memory_size(config.max_memory)
            .linear_memory_keep_resident(1 << 20)
            .table_keep_resident(64 << 10)
            .pagemap_scan(Enabled::Auto);
        wasm.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    }
    Engine::new(&wasm).map_err(|e| SandboxError::Engine(format!("{e:#}")))
}

/// How long the ticker goes on ticking after the last call ended, before it
/// rests until the next call (an idle host wakes no thread every tick).
const TICKER_REST_AFTER: Duration = Duration::from_millis(100);

/// Advances the engine's epoch every tick while calls run, until dropped.
///
/// `let ticker = EpochTicker::start(engine.clone(), Duration::from_millis(1))?;`
/// then `let _running = ticker.enter();` around each call.
pub struct EpochTicker {
    shared: Arc<TickerState>,
    thread: std::thread::Thread,
}

struct TickerState {
    stop: AtomicBool,
    /// Calls running now.
    running: AtomicUsize,
    /// The ticker thread is parked (no call ran for a while).
    resting: AtomicBool,
}

/// A call in flight: the ticker ticks at least until it is dropped.
pub struct Running<'a> {
    ticker: &'a EpochTicker,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.ticker.shared.running.fetch_sub(1, Ordering::Release);
    }
}

impl EpochTicker {
    /// Starts the ticker thread. Without it no deadline ever fires, so failing
    /// to start it is an error, not a warning.
    pub fn start(engine: Engine, tick: Duration) -> Result<Self> {
        Self::start_on(
            std::thread::Builder::new().name("idem-epoch".into()),
            engine,
            tick,
        )
    }

    fn start_on(thread: std::thread::Builder, engine: Engine, tick: Duration) -> Result<Self> {
        let shared = Arc::new(TickerState {
            stop: AtomicBool::new(false),
            running: AtomicUsize::new(0),
            resting: AtomicBool::new(false),
        });
        let state = shared.clone();
        let rest_after = (TICKER_REST_AFTER.as_nanos() / tick.as_nanos().max(1)).max(1);
        let handle = thread
            .spawn(move || {
                let mut idle_ticks = 0u128;
                while !state.stop.load(Ordering::Relaxed) {
                    if state.running.load(Ordering::Acquire) > 0 {
                        idle_ticks = 0;
                    } else {
                        idle_ticks += 1;
                    }
                    if idle_ticks > rest_after {
                        state.resting.store(true, Ordering::SeqCst);
                        // A call that began before `resting` was set is seen
                        // here; one that begins after it unparks.
                        if state.running.load(Ordering::SeqCst) == 0
                            && !state.stop.load(Ordering::Relaxed)
                        {
                            std::thread::park();
                        }
                        state.resting.store(false, Ordering::SeqCst);
                        idle_ticks = 0;
                        continue;
                    }
                    std::thread::sleep(tick);
                    engine.increment_epoch();
                }
            })
            .map_err(|error| {
                SandboxError::Engine(format!(
                    "cannot start the epoch ticker thread, so plugin deadlines could not fire: {error}"
                ))
            })?;
        Ok(EpochTicker {
            shared,
            thread: handle.thread().clone(),
        })
    }

    /// Marks a call as running until the guard is dropped; wakes the ticker
    /// if it rests.
    pub fn enter(&self) -> Running<'_> {
        self.shared.running.fetch_add(1, Ordering::SeqCst);
        if self.shared.resting.load(Ordering::SeqCst) {
            self.thread.unpark();
        }
        Running { ticker: self }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.thread.unpark();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticker_that_cannot_start_is_an_engine_error() {
        let engine = Engine::default();
        // A stack larger than any address space makes the spawn itself fail,
        // the way thread or memory exhaustion would.
        let thread = std::thread::Builder::new().stack_size(1 << 60);
        let error = match EpochTicker::start_on(thread, engine, Duration::from_millis(10)) {
            Ok(_) => panic!("a thread with a 2^60 byte stack started"),
            Err(error) => error,
        };
        assert!(
            matches!(&error, SandboxError::Engine(why) if why.contains("epoch ticker")),
            "{error}"
        );
    }
}
