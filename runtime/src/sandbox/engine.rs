//! Engine configuration and the epoch ticker that enforces deadlines.

use super::{Result, SandboxError};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
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
    /// Deadline resolution.
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
            epoch_tick: Duration::from_millis(10),
            cache_dir: None,
        }
    }
}

impl SandboxConfig {
    /// Epoch ticks for a deadline (at least one).
    pub fn deadline_ticks(&self, deadline: Duration) -> u64 {
        let tick = self.epoch_tick.as_nanos().max(1);
        (deadline.as_nanos().div_ceil(tick) as u64).max(1)
    }
}

/// Builds the engine. Keeping memories and tables resident with
/// `pagemap_scan` removes the page faults of a fresh instance's first call
/// (measured: 27 → 9 µs per job, see docs/benchmarks.md).
pub fn build(config: &SandboxConfig) -> Result<Engine> {
    let mut wasm = Config::new();
    wasm.epoch_interruption(true)
        .consume_fuel(config.fuel)
        .max_wasm_stack(config.max_stack)
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

/// Advances the engine's epoch every tick until dropped.
///
/// `let _ticker = EpochTicker::start(engine.clone(), Duration::from_millis(10))?;`
pub struct EpochTicker {
    stop: Arc<AtomicBool>,
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
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        thread
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    engine.increment_epoch();
                }
            })
            .map_err(|error| {
                SandboxError::Engine(format!(
                    "cannot start the epoch ticker thread, so plugin deadlines could not fire: {error}"
                ))
            })?;
        Ok(EpochTicker { stop })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
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
