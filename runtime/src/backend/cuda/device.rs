//! The driver-API layer under the CUDA backend: one context and stream, stream-ordered device
//! memory, pinned host staging, kernel modules and launches, graph capture.
//!
//! cudarc's safe slices track a read and a write event per buffer; captured step graphs then
//! depend on uncaptured events (measured: `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`), and every
//! launch pays for the bookkeeping. The backend needs neither — all work is in order on one
//! stream — so it holds raw device pointers and calls the driver through cudarc's `result`
//! wrappers, checking every return code.

use crate::backend::KernelTime;
use crate::error::{Result, RuntimeError};
use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A driver error as a runtime error naming the operation.
pub(crate) fn cuda_err(op: &'static str) -> impl Fn(DriverError) -> RuntimeError {
    move |e| RuntimeError::Cuda {
        op,
        msg: describe(e),
    }
}

fn launch_err(f: &Kernel, how: &str, e: DriverError) -> RuntimeError {
    RuntimeError::Cuda {
        op: "launching a kernel",
        msg: format!("{}{how}: {}", f.name, describe(e)),
    }
}

fn describe(e: DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("{:?}", e.0),
    }
}

/// Context, stream and device facts shared by every allocation of the backend.
pub(crate) struct Device {
    pub ctx: Arc<CudaContext>,
    stream_owner: Arc<CudaStream>,
    pub stream: sys::CUstream,
    pub name: String,
    pub sm_count: u32,
    pub compute: (i32, i32),
    /// Largest dynamic shared memory a block may opt in to.
    pub smem_optin: usize,
    /// Shared memory of one SM, shared by its resident blocks (each also holds the driver's
    /// per-block reserve).
    pub smem_per_sm: usize,
    pub smem_reserved_per_block: usize,
    /// Set by uploads of pinned staging areas (and graph launches that contain them); a
    /// host write to a staging area first waits for those to be done.
    staging_in_flight: AtomicBool,
    /// `SFX_PROFILE_KERNELS=1`: every launch outside graph capture is timed with a pair of
    /// events (a tuning aid: it adds a few µs per launch, so use it with step graphs off).
    profile: Option<Mutex<Vec<TimedLaunch>>>,
    capturing: AtomicBool,
    /// One more stream per branch lane ([`Device::begin_branch`]): launches go to
    /// lane `on_side − 1` while `on_side` is set, ordered after the main stream's work at the
    /// fork, and the main stream waits for them at the join. Captured, a branch becomes a
    /// parallel path of the step graph.
    side_owners: [Arc<CudaStream>; BRANCH_LANES],
    sides: [sys::CUstream; BRANCH_LANES],
    on_side: std::sync::atomic::AtomicUsize,
    fork_event: sys::CUevent,
    /// Points branches reached ([`Device::mark_branch`]), used in turn: a mark is joined
    /// within the next `BRANCH_MARKS − 1` marks (fetch lag keeps at most 2 × 66 waiting).
    marks: Vec<sys::CUevent>,
    next_mark: std::sync::atomic::AtomicUsize,
}

/// Branch lanes (`BranchLane`: near, far, lag).
const BRANCH_LANES: usize = 3;

/// Branch marks in the pool.
const BRANCH_MARKS: usize = 512;

/// One profiled launch: its kernel, grid and the events around it.
struct TimedLaunch {
    name: &'static str,
    grid: (u32, u32, u32),
    start: sys::CUevent,
    end: sys::CUevent,
}

// SAFETY: the raw stream handle is owned by `stream_owner` (kept alive with it); the driver API
// is thread-safe, and every call binds the context to the calling thread first.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: the branch events were created by `open` and are not used after this; the
        // driver releases an event with work still pending on it once that work completes.
        let _ = self.ctx.bind_to_thread();
        unsafe {
            let _ = result::event::destroy(self.fork_event);
            for &e in &self.marks {
                let _ = result::event::destroy(e);
            }
        }
    }
}

impl Device {
    /// Opens device `ordinal`: the caller has checked that libcuda is present.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("opening the device"))?;
        let stream_owner = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let stream = stream_owner.cu_stream();
        let side_owners = [
            ctx.new_stream().map_err(cuda_err("creating a stream"))?,
            ctx.new_stream().map_err(cuda_err("creating a stream"))?,
            ctx.new_stream().map_err(cuda_err("creating a stream"))?,
        ];
        let sides = side_owners.each_ref().map(|s| s.cu_stream());
        let event = || {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(cuda_err("creating a branch event"))
        };
        let fork_event = event()?;
        let marks = (0..BRANCH_MARKS)
            .map(|_| event())
            .collect::<Result<Vec<_>>>()?;
        let attr = |a| {
            ctx.attribute(a)
                .map_err(cuda_err("reading device attributes"))
        };
        use sys::CUdevice_attribute_enum as A;
        let sm_count = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32;
        let smem_optin = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0);
        let smem_per_sm = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?.max(0);
        let smem_reserved = attr(A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK)?.max(0);
        let compute = ctx
            .compute_capability()
            .map_err(cuda_err("reading the compute capability"))?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        Ok(Arc::new(Self {
            ctx,
            stream_owner,
            stream,
            name,
            sm_count,
            compute,
            smem_optin: smem_optin as usize,
            smem_per_sm: smem_per_sm as usize,
            smem_reserved_per_block: smem_reserved as usize,
            staging_in_flight: AtomicBool::new(false),
            profile: std::env::var("SFX_PROFILE_KERNELS")
                .is_ok_and(|v| v == "1")
                .then(|| Mutex::new(Vec::new())),
            capturing: AtomicBool::new(false),
            side_owners,
            sides,
            on_side: std::sync::atomic::AtomicUsize::new(0),
            fork_event,
            marks,
            next_mark: std::sync::atomic::AtomicUsize::new(0),
        }))
    }

    /// The stream launches go to: the side stream inside a branch.
    fn launch_stream(&self) -> sys::CUstream {
        match self.on_side.load(Ordering::Acquire) {
            0 => self.stream,
            lane => self.sides[lane - 1],
        }
    }

    /// Starts a branch on `lane` (`< BRANCH_LANES`): launches that follow go to that lane's stream,
    /// after everything queued on the main stream so far and on the lane before, until
    /// [`Device::end_branch`].
    pub fn begin_branch(&self, lane: usize) -> Result<()> {
        let Some(&side) = self.sides.get(lane) else {
            return Err(RuntimeError::Unsupported(format!(
                "branch lane {lane} of {BRANCH_LANES}"
            )));
        };
        if self.on_side.swap(lane + 1, Ordering::AcqRel) != 0 {
            return Err(RuntimeError::Unsupported("a branch inside a branch".into()));
        }
        // SAFETY: the streams and the event live as long as `self`.
        unsafe {
            result::event::record(self.fork_event, self.stream)
                .and_then(|()| {
                    result::stream::wait_event(
                        side,
                        self.fork_event,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                })
                .map_err(cuda_err("forking a branch"))
        }
    }

    /// The running branch's stream.
    fn branch_stream(&self) -> Result<sys::CUstream> {
        match self.on_side.load(Ordering::Acquire) {
            0 => Err(RuntimeError::Unsupported(
                "a branch operation outside a branch".into(),
            )),
            lane => Ok(self.sides[lane - 1]),
        }
    }

    /// The point the running branch has reached: [`Device::join_branch`] of it waits for the
    /// branch's launches so far, not for later ones.
    fn mark_branch(&self) -> Result<usize> {
        let side = self.branch_stream()?;
        let id = self.next_mark.fetch_add(1, Ordering::AcqRel) % BRANCH_MARKS;
        // SAFETY: as in begin_branch.
        unsafe { result::event::record(self.marks[id], side) }
            .map_err(cuda_err("marking a branch"))?;
        Ok(id)
    }

    /// Ends the branch's launches (the main stream goes on beside them) and returns the mark
    /// of its end.
    pub fn end_branch(&self) -> Result<usize> {
        let mark = self.mark_branch()?;
        self.on_side.store(0, Ordering::Release);
        Ok(mark)
    }

    /// The running branch's launches that follow wait for another branch's up to `mark`.
    pub fn branch_wait(&self, mark: usize) -> Result<()> {
        let side = self.branch_stream()?;
        self.wait_mark(side, mark)
    }

    fn wait_mark(&self, stream: sys::CUstream, mark: usize) -> Result<()> {
        let event = self.marks.get(mark).copied().ok_or_else(|| {
            RuntimeError::Unsupported(format!("branch mark {mark} of {BRANCH_MARKS}"))
        })?;
        // SAFETY: as in begin_branch.
        unsafe {
            result::stream::wait_event(
                stream,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(cuda_err("joining a branch"))
    }

    /// The main stream waits for a branch's launches up to `mark`.
    pub fn join_branch(&self, mark: usize) -> Result<()> {
        self.wait_mark(self.stream, mark)
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))
    }

    /// Device memory in use, device-wide (total − free): cudaMalloc'd buffers, the stream-
    /// ordered pool's reserve, graphs and the context itself.
    pub fn memory_in_use(&self) -> Result<u64> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(cuda_err("querying free device memory"))?;
        Ok(total.saturating_sub(free) as u64)
    }

    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.staging_in_flight.store(false, Ordering::Release);
        for side in &self.side_owners {
            side.synchronize().map_err(cuda_err("synchronizing"))?;
        }
        self.stream_owner
            .synchronize()
            .map_err(cuda_err("synchronizing"))
    }

    pub fn note_staging_read(&self) {
        self.staging_in_flight.store(true, Ordering::Release);
    }

    /// Waits for queued copies out of pinned staging before the host overwrites one.
    pub fn before_staging_write(&self) -> Result<()> {
        if self.staging_in_flight.load(Ordering::Acquire) {
            self.synchronize()?;
        }
        Ok(())
    }

    /// Stream-ordered allocation of `bytes` (at least 16, so empty buffers have an address).
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceMem> {
        self.bind()?;
        // SAFETY: the stream is valid for the life of `self`.
        let ptr = unsafe { result::malloc_async(self.stream, bytes.max(16)) }.map_err(|e| {
            RuntimeError::Cuda {
                op: "allocating device memory",
                msg: format!("{} bytes: {}", bytes, describe(e)),
            }
        })?;
        Ok(DeviceMem {
            ptr,
            bytes,
            device: self.clone(),
        })
    }

    /// A new allocation holding `bytes` (weights and tables at load).
    pub fn upload_new(self: &Arc<Self>, bytes: &[u8]) -> Result<DeviceMem> {
        let mem = self.alloc(bytes.len())?;
        self.upload_bytes(mem.ptr, bytes)?;
        Ok(mem)
    }

    pub fn alloc_zeroed(self: &Arc<Self>, bytes: usize) -> Result<DeviceMem> {
        let m = self.alloc(bytes)?;
        // SAFETY: `m` holds at least `bytes` bytes.
        unsafe { result::memset_d8_async(m.ptr, 0, bytes.max(16), self.stream) }
            .map_err(cuda_err("clearing device memory"))?;
        Ok(m)
    }

    /// Host → device, ordered on the stream. For pageable `src` the driver has copied it
    /// out before this returns, so the caller may reuse `src` at once.
    pub fn upload_bytes(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller passes a destination of at least src.len() bytes.
        unsafe { result::memcpy_htod_async(dst, src, self.stream) }
            .map_err(cuda_err("copying to the device"))
    }

    /// Device → host; waits for everything queued before it.
    pub fn download_bytes(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.bind()?;
        if !dst.is_empty() {
            // SAFETY: the caller passes a source of at least dst.len() bytes; the sync below
            // completes the copy before `dst` is used.
            unsafe { result::memcpy_dtoh_async(dst, src, self.stream) }
                .map_err(cuda_err("copying from the device"))?;
        }
        self.synchronize()
    }

    pub fn copy_device(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges are inside allocations checked by the caller.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream) }
            .map_err(cuda_err("copying on the device"))
    }

    /// Launches `f` with the argument pointers `args` (each pointing at a value of the
    /// kernel parameter's type).
    pub fn launch(
        &self,
        f: &Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let timing = self.start_timing()?;
        // SAFETY: `f` comes from a loaded module; the caller passes arguments matching the
        // kernel's signature and buffers large enough for the grid.
        unsafe { result::launch_kernel(f.func, grid, block, smem, self.launch_stream(), args) }
            .map_err(|e| launch_err(f, "", e))?;
        self.end_timing(timing, f, grid)
    }

    /// The start event of a profiled launch (None when not profiling, or while capturing).
    fn start_timing(&self) -> Result<Option<sys::CUevent>> {
        if self.profile.is_none() || self.capturing.load(Ordering::Acquire) {
            return Ok(None);
        }
        let e = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(cuda_err("creating a profiling event"))?;
        // SAFETY: a fresh event on this context's stream.
        unsafe { result::event::record(e, self.stream) }
            .map_err(cuda_err("recording a profiling event"))?;
        Ok(Some(e))
    }

    fn end_timing(
        &self,
        start: Option<sys::CUevent>,
        f: &Kernel,
        grid: (u32, u32, u32),
    ) -> Result<()> {
        let (Some(start), Some(list)) = (start, &self.profile) else {
            return Ok(());
        };
        let end = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(cuda_err("creating a profiling event"))?;
        // SAFETY: as in start_timing.
        unsafe { result::event::record(end, self.stream) }
            .map_err(cuda_err("recording a profiling event"))?;
        if let Ok(mut l) = list.lock() {
            l.push(TimedLaunch {
                name: f.name,
                grid,
                start,
                end,
            });
        }
        Ok(())
    }

    /// The profiled launches so far, summed by kernel and grid (largest total first), and
    /// forgotten; empty unless `SFX_PROFILE_KERNELS=1`.
    pub fn take_kernel_times(&self) -> Result<Vec<KernelTime>> {
        let Some(list) = &self.profile else {
            return Ok(Vec::new());
        };
        self.synchronize()?;
        let launches = std::mem::take(
            &mut *list
                .lock()
                .map_err(|_| RuntimeError::Unsupported("kernel profile poisoned".into()))?,
        );
        let mut by_kernel: Vec<KernelTime> = Vec::new();
        for l in launches {
            // SAFETY: both events were recorded on this stream, which is synchronized.
            let ms = unsafe { result::event::elapsed(l.start, l.end) };
            // SAFETY: the events are not used again.
            unsafe {
                let _ = result::event::destroy(l.start);
                let _ = result::event::destroy(l.end);
            }
            let us = f64::from(ms.map_err(cuda_err("reading a profiling event"))?) * 1e3;
            let grid = [l.grid.0, l.grid.1, l.grid.2];
            match by_kernel
                .iter_mut()
                .find(|k| k.kernel == l.name && k.grid == grid)
            {
                Some(k) => {
                    k.launches += 1;
                    k.total_us += us;
                }
                None => by_kernel.push(KernelTime {
                    kernel: l.name.to_string(),
                    grid,
                    launches: 1,
                    total_us: us,
                }),
            }
        }
        by_kernel.sort_by(|a, b| b.total_us.total_cmp(&a.total_us));
        Ok(by_kernel)
    }

    /// [`Device::launch`] with programmatic dependent launch: the kernel may start before the
    /// previous one completes and must wait (`griddepcontrol.wait`) before touching its data.
    pub fn launch_pdl(
        &self,
        f: &Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // SAFETY: plain-old-data attribute; the union member set is the one the id names.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: self.launch_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let timing = self.start_timing()?;
        // SAFETY: as for `launch`; the config and attribute outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, f.func, args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| launch_err(f, " (PDL)", e))?;
        self.end_timing(timing, f, grid)
    }

    pub fn begin_capture(&self) -> Result<()> {
        self.bind()?;
        // Thread-local mode: only this thread's unsafe calls (none are made) break capture.
        // SAFETY: the stream is valid.
        unsafe {
            result::stream::begin_capture(
                self.stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(cuda_err("starting graph capture"))?;
        self.capturing.store(true, Ordering::Release);
        Ok(())
    }

    pub fn end_capture(self: &Arc<Self>) -> Result<Graph> {
        self.bind()?;
        self.capturing.store(false, Ordering::Release);
        // SAFETY: capture was started on this stream.
        let graph = unsafe { result::stream::end_capture(self.stream) }
            .map_err(cuda_err("ending graph capture"))?;
        if graph.is_null() {
            return Err(RuntimeError::Cuda {
                op: "ending graph capture",
                msg: "the capture recorded no graph".into(),
            });
        }
        // SAFETY: `graph` is the captured graph; on failure it is destroyed here.
        let exec =
            match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(e) => e,
                Err(e) => {
                    let _ = unsafe { result::graph::destroy(graph) };
                    return Err(cuda_err("instantiating the step graph")(e));
                }
            };
        let g = Graph {
            graph,
            exec,
            device: self.clone(),
        };
        // SAFETY: exec and stream are valid. Uploading now keeps set-up out of the first step.
        unsafe { result::graph::upload(g.exec, self.stream) }
            .map_err(cuda_err("uploading the step graph"))?;
        Ok(g)
    }

    pub fn launch_graph(&self, g: &Graph) -> Result<()> {
        self.bind()?;
        self.note_staging_read();
        // SAFETY: exec and stream are valid.
        unsafe { result::graph::launch(g.exec, self.stream) }
            .map_err(cuda_err("launching the step graph"))
    }

    /// Loads one embedded module (a fat binary) and resolves `names` in it.
    pub fn load_module(&self, module: &str, image: &[u8]) -> Result<Module> {
        self.bind()?;
        // The driver reads the image through aligned loads: give it an 8-byte-aligned copy.
        let mut aligned = vec![0u64; image.len().div_ceil(8) + 1];
        bytemuck::cast_slice_mut::<u64, u8>(&mut aligned)[..image.len()].copy_from_slice(image);
        // SAFETY: `aligned` holds a complete fat binary and outlives the call.
        let m = unsafe { result::module::load_data(aligned.as_ptr() as *const c_void) }.map_err(
            |e| RuntimeError::Cuda {
                op: "loading kernels",
                msg: format!(
                    "module {module} on {} (sm_{}{}): {} — the embedded kernels cover sm_75 and \
                     newer",
                    self.name,
                    self.compute.0,
                    self.compute.1,
                    describe(e)
                ),
            },
        )?;
        Ok(Module {
            module: m,
            name: module.to_string(),
        })
    }
}

/// A loaded module; its functions stay valid while the backend lives (modules are never
/// unloaded before the process ends, so kernels can be copied freely).
pub(crate) struct Module {
    module: sys::CUmodule,
    name: String,
}

// SAFETY: module handles are process-wide driver objects.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    pub fn function(&self, name: &'static str) -> Result<Kernel> {
        let c = CString::new(name).map_err(|_| RuntimeError::Cuda {
            op: "loading kernels",
            msg: format!("bad kernel name {name:?}"),
        })?;
        // SAFETY: the module is loaded.
        let func = unsafe { result::module::get_function(self.module, c) }.map_err(|e| {
            RuntimeError::Cuda {
                op: "loading kernels",
                msg: format!("{name} in module {}: {}", self.name, describe(e)),
            }
        })?;
        Ok(Kernel { func, name })
    }
}

/// One kernel entry point.
#[derive(Clone, Copy)]
pub(crate) struct Kernel {
    func: sys::CUfunction,
    pub name: &'static str,
}

// SAFETY: function handles are immutable driver objects.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Allows as much dynamic shared memory per block as `optin` (the device's per-block
    /// opt-in limit) leaves beside the kernel's static shared memory.
    pub fn allow_shared(&self, optin: usize) -> Result<()> {
        // SAFETY: valid function handle.
        let fixed = unsafe {
            result::function::get_function_attribute(
                self.func,
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            )
        }
        .unwrap_or(0)
        .max(0) as usize;
        let bytes = optin.saturating_sub(fixed);
        // SAFETY: valid function handle.
        unsafe {
            result::function::set_function_attribute(
                self.func,
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .map_err(|e| RuntimeError::Cuda {
            op: "configuring a kernel",
            msg: format!("{}: {}", self.name, describe(e)),
        })
    }
}

impl Kernel {
    /// Blocks of `threads` threads with `smem` bytes of dynamic shared memory that fit on one
    /// SM at once (registers, shared memory, threads); 1 if the driver cannot say.
    pub fn blocks_per_sm(&self, threads: usize, smem: usize) -> usize {
        // SAFETY: valid function handle; the query reads only its attributes.
        unsafe {
            result::occupancy::max_active_block_per_multiprocessor(
                self.func,
                threads as std::ffi::c_int,
                smem,
            )
        }
        .map_or(1, |n| n.max(1) as usize)
    }
}

/// Device memory freed in stream order when dropped.
pub(crate) struct DeviceMem {
    pub ptr: u64,
    pub bytes: usize,
    device: Arc<Device>,
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: `ptr` came from malloc_async on this stream; work queued before the free
            // still sees the memory.
            let _ = unsafe { result::free_async(self.ptr, self.device.stream) };
        }
    }
}

/// Page-locked host memory the device copies from (staging of index buffers).
pub(crate) struct PinnedMem {
    ptr: *mut u8,
    bytes: usize,
    device: Arc<Device>,
}

// SAFETY: the allocation is plain host memory owned by this value.
unsafe impl Send for PinnedMem {}
unsafe impl Sync for PinnedMem {}

impl PinnedMem {
    pub fn new(device: &Arc<Device>, bytes: usize) -> Result<Self> {
        Self::with_flags(device, bytes, 0)
    }

    /// Zeroed page-locked memory allocated with `cuMemHostAlloc` `flags`.
    fn with_flags(device: &Arc<Device>, bytes: usize, flags: u32) -> Result<Self> {
        device.bind()?;
        let bytes = bytes.max(16);
        // SAFETY: plain pinned allocation, freed in Drop.
        let ptr = unsafe { result::malloc_host(bytes, flags) }.map_err(|e| RuntimeError::Cuda {
            op: "allocating pinned host memory",
            msg: format!("{bytes} bytes: {}", describe(e)),
        })? as *mut u8;
        // SAFETY: `ptr` holds `bytes` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(Self {
            ptr,
            bytes,
            device: device.clone(),
        })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `bytes` bytes exclusively owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }

    /// Enqueues a copy of the first `bytes` bytes to `dst` (recordable into a graph).
    pub fn copy_to_device(&self, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let bytes = bytes.min(self.bytes);
        self.device.bind()?;
        self.device.note_staging_read();
        // SAFETY: pinned source of at least `bytes` bytes that outlives the copy (the backend
        // waits before the host writes it again).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, self.ptr as *const c_void, bytes, self.device.stream)
        }
        .result()
        .map_err(cuda_err("copying staged values to the device"))
    }
}

impl Drop for PinnedMem {
    fn drop(&mut self) {
        // Queued copies may still read it.
        let _ = self.device.synchronize();
        // SAFETY: allocated by malloc_host.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

/// Page-locked host memory mapped into the device's address space: kernels read it over the
/// bus (zero-copy), the host writes it in place. The backing tier of KV refinement units,
/// of which a step reads a few scattered groups — copying it to the device would cost more
/// than the reads. Freed (after the stream's queued work) as [`PinnedMem`] is.
pub(crate) struct MappedMem {
    host: PinnedMem,
    /// The device's address of the same bytes.
    pub dptr: u64,
}

impl MappedMem {
    pub fn new(device: &Arc<Device>, bytes: usize) -> Result<Self> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        let host = PinnedMem::with_flags(device, bytes, flags)?;
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `host.ptr` was allocated with the DEVICEMAP flag in this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host.ptr as *mut c_void, 0) }
            .result()
            .map_err(cuda_err("mapping host memory into the device"))?;
        Ok(Self { host, dptr })
    }

    /// The bytes, once the stream's queued work (which may read them) is done.
    pub fn settled(&self) -> Result<&[u8]> {
        self.host.device.synchronize()?;
        // SAFETY: `ptr` holds `bytes` bytes owned by `self`; no queued kernel is running.
        Ok(unsafe { std::slice::from_raw_parts(self.host.ptr, self.host.bytes) })
    }

    /// The bytes for writing, once the stream's queued work (which may read them) is done.
    pub fn settled_mut(&mut self) -> Result<&mut [u8]> {
        self.host.device.synchronize()?;
        Ok(self.host.as_mut_slice())
    }
}

/// An instantiated step graph.
pub(crate) struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    device: Arc<Device>,
}

// SAFETY: graph handles are only used behind the model's state mutex.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.device.synchronize();
        // SAFETY: handles created by end_capture, destroyed once.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}
