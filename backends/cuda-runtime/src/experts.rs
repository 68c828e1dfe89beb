//! Mixture-of-Experts layers on the device, on the device throughout: the router's logits,
//! the routing kernel's choice of experts and their weights (`route_experts`), the chosen
//! experts' gated activations and down projections (GEMVs that read only those experts'
//! rows, by the ids the routing kernel wrote: [`ExpertSlots`]), and their weighted sum
//! joining the residual stream (`combine_experts`). Nothing returns to the host, so the
//! decode step stays one graph.
//!
//! The decode step runs a layer for its one token; the batched step and the prefill run it
//! for a batch's or a chunk's rows, each (token, chosen expert) pair a slot. Few rows take
//! the expert GEMVs, a slot each reading its expert's rows (from L2 where several slots
//! share an expert). Enough rows that the experts are chosen several times each take the
//! grouped matmuls instead (`grouped_matmul`, the dense batched step's int8 tensor-core
//! walk): the slots sorted by expert, each expert's rows read once for up to 64 of its
//! slots.

use kiln_core::ModelConfig;
use kiln_kernels::{
    Carver, DevSlice, Device, DeviceBuffer, DeviceWeight, Epilogue, ExpertGroups, ExpertSlots,
    GatedAct, GemvInput, Kernels, PackedAct, Q8Act, QuantOut,
};

use super::{DeviceBranch, DeviceOp, GpuExecutor};

/// A program's Mixture of Experts on the device (see [`kiln_core::program::Experts`]): the
/// router, and each projection's experts stacked into one weight (expert `e`'s rows from
/// `e` times its width), which the expert GEMVs index by the ids the routing kernel wrote.
pub(super) struct DeviceExperts {
    pub(super) router: DeviceWeight,
    pub(super) router_bias: Option<DeviceBuffer<f32>>,
    pub(super) gate: DeviceWeight,
    pub(super) up: DeviceWeight,
    pub(super) down: DeviceWeight,
    /// Each expert's gate rows' biases then its up rows' (`swiglu_slots`' and
    /// `grouped_matmul`'s layout), and the down rows' biases expert after expert.
    pub(super) gate_up_bias: Option<DeviceBuffer<f32>>,
    pub(super) down_bias: Option<DeviceBuffer<f32>>,
    pub(super) count: usize,
    pub(super) used: usize,
    pub(super) normalize: bool,
    pub(super) act: GatedAct,
}

impl DeviceExperts {
    /// The rows of one expert's gate (and up) matrix.
    fn width(&self) -> usize {
        self.gate.rows / self.count
    }

    /// Whether `rows` tokens take the grouped matmuls rather than the expert GEMVs: when
    /// the weights have a batched matmul and the tokens choose each expert about once or
    /// more (`rows · used ≥ count`, and at least 8 rows, a tile's). Below that most chosen
    /// experts have one slot, which a grouped tile multiplies with seven idle columns on
    /// far fewer blocks than the GEMVs' row splits spread over the SMs.
    fn grouped(&self, rows: usize) -> bool {
        let batched = |w: &DeviceWeight| {
            w.format.batched.is_some()
                && w.row_len.is_multiple_of(32)
                && (w.rows / self.count).is_multiple_of(w.format.row_group)
        };
        rows >= 8 && rows * self.used >= self.count && batched(&self.gate) && batched(&self.down)
    }
}

/// What [`ExpertBuffers`] must hold: `rows` tokens at once, `count` experts a layer at
/// most, `used` of them a token, each of `width` rows, over a hidden vector of `hidden`.
pub(super) struct BufferShape {
    rows: usize,
    count: usize,
    used: usize,
    width: usize,
    hidden: usize,
}

impl BufferShape {
    /// The buffers `branches` need: none without experts; else for the most experts any
    /// layer has and uses, and as many rows as a prefill chunk or a batched step holds.
    pub(super) fn of(branches: &[DeviceBranch], c: &ModelConfig, max_ctx: usize) -> BufferShape {
        let (count, used, width) = branches.iter().fold((0, 0, 0), |(n, u, w), b| match &b.op {
            DeviceOp::Experts(e) => (n.max(e.count), u.max(e.used), w.max(e.width())),
            _ => (n, u, w),
        });
        let rows = if count == 0 {
            0
        } else {
            super::prefill::CHUNK.min(max_ctx).max(Kernels::MAX_BATCH)
        };
        BufferShape {
            rows,
            count,
            used,
            width: width.next_multiple_of(32),
            hidden: c.hidden_size,
        }
    }
}

/// A Mixture of Experts' activations for up to [`BufferShape`]'s rows.
pub(super) struct ExpertBuffers {
    /// Each row's normed input, quantised (the batched step's and the prefill's; the decode
    /// step's experts read the stream's own planes, their norm pending).
    xq: Q8Act,
    /// Zeros: every row's slot multiplies the one router matrix.
    router_ids: DevSlice<i32>,
    /// The router's logits, `count` a row.
    logits: DevSlice<f32>,
    /// The experts each row chose and their weights, `used` a row, and the slots (a row's
    /// chosen experts) sorted by expert.
    ids: DevSlice<i32>,
    order: DevSlice<i32>,
    weights: DevSlice<f32>,
    /// Each slot's gated activation, f32 and quantised for the down projection.
    gated: DevSlice<f32>,
    gated_q: Q8Act,
    /// Each slot's down projection, `hidden` values.
    out: DevSlice<f32>,
    /// The grouped matmuls': where each expert's slots begin in `order`, and the rows'
    /// normed inputs and the slots' gated activations packed for the tensor cores.
    starts: DevSlice<i32>,
    packed_x: PackedAct,
    packed_gated: PackedAct,
}

impl ExpertBuffers {
    pub(super) fn carve(a: &mut Carver, s: &BufferShape) -> ExpertBuffers {
        let mut planes = |n: usize| {
            let padded = n.div_ceil(32) * 32;
            Q8Act {
                q: a.take(padded),
                lo: a.take(padded),
                ds: a.take(padded / 32),
            }
        };
        let xq = planes(s.rows * s.hidden.next_multiple_of(32));
        let gated_q = planes(s.rows * s.used * s.width);
        let mut packed = |rows: usize, n: usize| {
            let (x, sums) = PackedAct::lens(rows, n);
            PackedAct {
                x: a.take(x),
                s: a.take(sums),
                h: a.take(x),
            }
        };
        let packed_x = packed(s.rows, s.hidden);
        let packed_gated = packed(s.rows * s.used, s.width);
        ExpertBuffers {
            xq,
            gated_q,
            packed_x,
            packed_gated,
            starts: a.take(s.count + 1),
            router_ids: a.take(s.rows),
            logits: a.take(s.rows * s.count),
            ids: a.take(s.rows * s.used),
            order: a.take(s.rows * s.used),
            weights: a.take(s.rows * s.used),
            gated: a.take(s.rows * s.used * s.width),
            out: a.take(s.rows * s.used * s.hidden),
        }
    }

    /// Sets the router's slot ids to zero (after the workspace's poisoning).
    pub(super) fn clear_router_ids(&self, device: &Device) -> kiln_kernels::Result<()> {
        self.router_ids.fill_bytes_async(device, 0)
    }
}

impl GpuExecutor {
    /// The decode step's Mixture of Experts for its one token: `input` is the residual
    /// stream's planes with this branch's norm pending, and the stream comes out quantised
    /// into `next` as `residual_gemv` leaves it.
    pub(super) fn queue_experts(
        &self,
        e: &DeviceExperts,
        input: &GemvInput,
        b: &DeviceBranch,
        next: QuantOut,
    ) -> kiln_kernels::Result<()> {
        self.run_experts(e, b, 1, input, self.s.x, self.s.proj, Some(&next))
    }

    /// A Mixture of Experts over `rows` rows of the residual stream `x` (the batched step's
    /// or a prefill chunk's, f32): each row normed and quantised, then as
    /// [`GpuExecutor::run_experts`] (`proj` holds `rows` rows). The caller packs `x` for
    /// what reads it next.
    pub(super) fn experts_rows(
        &self,
        e: &DeviceExperts,
        b: &DeviceBranch,
        x: DevSlice<f32>,
        rows: usize,
        proj: DevSlice<f32>,
    ) -> kiln_kernels::Result<()> {
        let c = &self.config;
        let xq = self.s.moe.xq;
        self.k.rmsnorm_q8_1(
            x,
            rows,
            c.hidden_size,
            Some(b.norm.slice()),
            Some(c.norm_eps),
            None,
            Some(xq),
        )?;
        if e.grouped(rows) {
            let packed = self.s.moe.packed_x;
            self.k.act_pack(
                x,
                rows,
                c.hidden_size,
                Some(b.norm.slice()),
                Some(c.norm_eps),
                packed,
            )?;
        }
        let input = GemvInput {
            x: None,
            q8: Some(xq),
            norm: None,
        };
        self.run_experts(e, b, rows, &input, x, proj, None)
    }

    /// `rows` tokens' experts, their normed inputs in `input` (one a token): routed, run,
    /// and their weighted sum added to the rows of the stream `x` (through `proj` with a
    /// sandwich norm); with `next`, the stream (one row) also quantised for the next GEMV.
    #[allow(clippy::too_many_arguments)]
    fn run_experts(
        &self,
        e: &DeviceExperts,
        b: &DeviceBranch,
        rows: usize,
        input: &GemvInput,
        x: DevSlice<f32>,
        proj: DevSlice<f32>,
        next: Option<&QuantOut>,
    ) -> kiln_kernels::Result<()> {
        self.experts_over(e, rows, input)?;
        let (k, c) = (&self.k, &self.config);
        let h = c.hidden_size;
        let weights = self.s.moe.weights.sub(0, rows * e.used)?;
        let out = self.s.moe.out.sub(0, rows * e.used * h)?;
        let scale = b.scale.unwrap_or(1.0);
        match &b.post_norm {
            Some(post) => {
                k.combine_experts(out, weights, rows, e.used, h, scale, None, proj, None)?;
                k.add_rmsnorm_rows(proj, rows, h, post.slice(), c.norm_eps, x)?;
                match next {
                    Some(next) => k.quantize(x, h, next),
                    None => Ok(()),
                }
            }
            None => k.combine_experts(out, weights, rows, e.used, h, scale, Some(x), x, next),
        }
    }

    /// Router, routing, gated activations and down projections of `rows` tokens whose
    /// normed inputs `input` holds (one a token), leaving each token's experts' outputs and
    /// weights in the buffers.
    fn experts_over(
        &self,
        e: &DeviceExperts,
        rows: usize,
        input: &GemvInput,
    ) -> kiln_kernels::Result<()> {
        let (k, m) = (&self.k, &self.s.moe);
        let h = self.config.hidden_size;
        let width = e.width();
        let slots = rows * e.used;
        let logits = m.logits.sub(0, rows * e.count)?;
        let ids = m.ids.sub(0, slots)?;
        let weights = m.weights.sub(0, slots)?;
        let router_epi = Epilogue {
            bias: e.router_bias.as_ref().map(|b| b.slice()),
            ..Default::default()
        };
        // A batch's rows each multiply the one router matrix: a slot a row. One row takes
        // the plain GEMV, which prefetches its weights before the wait.
        let each_row = match rows {
            1 => None,
            _ => Some(ExpertSlots {
                count: 1,
                ids: m.router_ids.sub(0, rows)?,
                slots_per_input: 1,
                order: None,
            }),
        };
        let router_tiling = self.tiling(&e.router);
        k.gemv_slots(
            &e.router,
            each_row.as_ref(),
            input,
            self.path,
            router_tiling,
            logits,
            &router_epi,
        )?;
        k.route_experts(logits, rows, e.count, e.used, e.normalize, ids, weights)?;
        if e.grouped(rows) {
            // experts_rows packed the rows' normed inputs.
            let groups = ExpertGroups {
                count: e.count,
                order: m.order.sub(0, slots)?,
                starts: m.starts.sub(0, e.count + 1)?,
                slots_per_input: e.used,
            };
            k.order_experts(ids, e.count, groups.order, Some(groups.starts))?;
            let gated = m.gated.sub(0, slots * width)?;
            k.grouped_matmul(
                &e.gate,
                Some(&e.up),
                &groups,
                &m.packed_x,
                rows,
                gated,
                width,
                e.gate_up_bias.as_ref().map(|b| b.slice()),
                e.act,
            )?;
            k.act_pack(gated, slots, width, None, None, m.packed_gated)?;
            let own = ExpertGroups {
                slots_per_input: 1,
                ..groups
            };
            let out = m.out.sub(0, slots * h)?;
            return k.grouped_matmul(
                &e.down,
                None,
                &own,
                &m.packed_gated,
                slots,
                out,
                h,
                e.down_bias.as_ref().map(|b| b.slice()),
                GatedAct::Silu,
            );
        }
        // Several tokens' slots run sorted by expert, so the blocks running at once share
        // an expert's rows in L2.
        let order = if rows > 1 {
            let order = m.order.sub(0, slots)?;
            k.order_experts(ids, e.count, order, None)?;
            Some(order)
        } else {
            None
        };
        let per_token = ExpertSlots {
            count: e.count,
            ids,
            slots_per_input: e.used,
            order,
        };
        let gated_q = QuantOut {
            q: m.gated_q,
            norm_w: None,
            norm_parts: None,
        };
        k.swiglu_slots(
            &e.gate,
            &e.up,
            Some(&per_token),
            input,
            self.path,
            self.quant_tiling_of(&e.gate),
            m.gated.sub(0, slots * width)?,
            Some(gated_q),
            e.gate_up_bias.as_ref().map(|b| b.slice()),
            e.act,
        )?;
        let own = ExpertSlots {
            slots_per_input: 1,
            ..per_token
        };
        let gated = GemvInput {
            x: None,
            q8: Some(m.gated_q),
            norm: None,
        };
        k.gemv_slots(
            &e.down,
            Some(&own),
            &gated,
            self.path,
            self.tiling(&e.down),
            m.out.sub(0, slots * h)?,
            &Epilogue {
                bias: e.down_bias.as_ref().map(|b| b.slice()),
                ..Default::default()
            },
        )
    }
}
