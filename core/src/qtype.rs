//! Tensor element types and their block geometry.
//!
//! Ids are ggml's type ids for the ggml types (what GGUF stores on disk) and 128 and up for
//! kiln's own types that come from other formats (APR's dtype ids), so the two ranges never
//! collide: [`QType::from_ggml_id`] accepts only the former, [`QType::from_id`] both.

use crate::error::{Error, Result};
use crate::quant::{TypeRecord, RECORDS};

/// A tensor's storage type. Discriminants are kiln's type ids: ggml's type id for every
/// ggml type (which GGUF stores on disk), 128 and up for types ggml does not have.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum QType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    /// 2.06 bits a value: groups of 8 from a 256-row lattice with 7-bit signs, a 4-bit scale
    /// a 32-value sub-block. The grid I-quants are in [`crate::quant::iquants_grid`].
    IQ2_XXS = 16,
    /// 2.31 bits: 9-bit lattice indices, a scale per 16 values.
    IQ2_XS = 17,
    /// 3.06 bits: groups of 4 from a 256-row lattice.
    IQ3_XXS = 18,
    /// 1.56 bits: groups of 8 of −1, 0, 1 (plus a shared ±1/8) from a 2,048-row lattice.
    IQ1_S = 19,
    /// Non-linear 4-bit levels, 32 values and an f16 scale a block. See
    /// [`crate::quant::iquants`].
    IQ4_NL = 20,
    /// 3.44 bits: 9-bit lattice indices of groups of 4, explicit signs.
    IQ3_S = 21,
    /// 2.56 bits: 10-bit lattice indices, explicit signs.
    IQ2_S = 22,
    /// IQ4_NL's levels in 256-value super-blocks with 6-bit sub-block scales.
    IQ4_XS = 23,
    /// 1.75 bits: IQ1_S's lattice with a scale per 16 values.
    IQ1_M = 29,
    BF16 = 30,
    /// OCP microscaling FP4 (gpt-oss's experts): 32 E2M1 values and an E8M0 exponent a
    /// block. See [`crate::quant::mxfp4`].
    MXFP4 = 39,
    /// APR's 4-bit block type (APR v2 dtype id 128; not ggml's Q4_0). Per 32 values: an f16
    /// scale `d`, then 16 bytes of nibbles; value `i` is the low nibble of byte `i / 2` when
    /// `i` is even and the high nibble when odd; `x = d·(q − 8)`. Not a ggml type: GGUF
    /// cannot hold it. See [`crate::quant::apr`].
    AprQ4 = 128,
}

impl QType {
    /// Every type kiln knows, in id order.
    pub const ALL: [QType; 26] = [
        QType::F32,
        QType::F16,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q8_1,
        QType::Q2_K,
        QType::Q3_K,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::Q8_K,
        QType::IQ2_XXS,
        QType::IQ2_XS,
        QType::IQ3_XXS,
        QType::IQ1_S,
        QType::IQ4_NL,
        QType::IQ3_S,
        QType::IQ2_S,
        QType::IQ4_XS,
        QType::IQ1_M,
        QType::BF16,
        QType::MXFP4,
        QType::AprQ4,
    ];

    /// Ids from here up are kiln's own types (APR's); below are ggml's.
    pub const KILN_ID_BASE: u32 = 128;

    /// The ggml types among [`QType::ALL`] (those a GGUF file can hold), in id order.
    pub fn ggml() -> impl Iterator<Item = QType> {
        QType::ALL.into_iter().filter(|q| q.is_ggml())
    }

    /// The ggml type with this id (as GGUF stores it). Kiln's own types are refused: their
    /// ids are not ggml's, and a GGUF file naming one is malformed.
    pub fn from_ggml_id(id: u32) -> Option<QType> {
        QType::from_id(id).filter(|q| q.is_ggml())
    }

    /// The type with this kiln id ([`QType::id`]): every ggml type and kiln's own (the
    /// plugin ABI carries these ids).
    pub fn from_id(id: u32) -> Option<QType> {
        QType::ALL.iter().copied().find(|q| *q as u32 == id)
    }

    /// Kiln's id for this type: ggml's id for a ggml type, 128 and up otherwise.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Whether ggml (and so GGUF) has this type.
    pub fn is_ggml(self) -> bool {
        self.id() < QType::KILN_ID_BASE
    }

    /// The ggml type id. Only meaningful when [`QType::is_ggml`]: for kiln's own types this
    /// is their kiln id, which no ggml build knows, so a GGUF writer must check `is_ggml`
    /// first.
    pub fn ggml_id(self) -> u32 {
        self as u32
    }

    /// Everything core knows about this type: its one record ([`crate::quant::TypeRecord`]).
    pub fn record(self) -> &'static TypeRecord {
        // Records are in `ALL`'s order (a test holds them to it).
        let i = match self {
            QType::F32 => 0,
            QType::F16 => 1,
            QType::Q4_0 => 2,
            QType::Q4_1 => 3,
            QType::Q5_0 => 4,
            QType::Q5_1 => 5,
            QType::Q8_0 => 6,
            QType::Q8_1 => 7,
            QType::Q2_K => 8,
            QType::Q3_K => 9,
            QType::Q4_K => 10,
            QType::Q5_K => 11,
            QType::Q6_K => 12,
            QType::Q8_K => 13,
            QType::IQ2_XXS => 14,
            QType::IQ2_XS => 15,
            QType::IQ3_XXS => 16,
            QType::IQ1_S => 17,
            QType::IQ4_NL => 18,
            QType::IQ3_S => 19,
            QType::IQ2_S => 20,
            QType::IQ4_XS => 21,
            QType::IQ1_M => 22,
            QType::BF16 => 23,
            QType::MXFP4 => 24,
            QType::AprQ4 => 25,
        };
        &RECORDS[i]
    }

    /// Lower-case name as llama.cpp prints it (`q4_k`, `f16`, ...); `apr_q4` for APR's Q4.
    pub fn name(self) -> &'static str {
        self.record().name
    }

    pub fn from_name(name: &str) -> Option<QType> {
        let lower = name.to_ascii_lowercase();
        QType::ALL.iter().copied().find(|q| q.name() == lower)
    }

    /// Number of values in one block.
    pub fn block_len(self) -> usize {
        self.record().block_len
    }

    /// Bytes in one block.
    pub fn block_bytes(self) -> usize {
        self.record().block_bytes
    }

    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Bytes of a row of `n` values. Fails when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let block = self.block_len();
        if !n.is_multiple_of(block) {
            return Err(Error::InvalidShape(format!(
                "a {} row holds whole blocks of {block} values; {n} is not a multiple",
                self.name()
            )));
        }
        (n / block).checked_mul(self.block_bytes()).ok_or_else(|| {
            Error::InvalidShape(format!("{n} values of {} overflow usize", self.name()))
        })
    }

    /// Bytes of a tensor with these dims (`dims[0]` is the contiguous row length).
    pub fn tensor_bytes(self, dims: &[usize]) -> Result<usize> {
        let row_len = dims.first().copied().unwrap_or(1);
        let rows = dims
            .iter()
            .skip(1)
            .try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let rows =
            rows.ok_or_else(|| Error::InvalidShape(format!("dims {dims:?} overflow usize")))?;
        self.row_bytes(row_len)?
            .checked_mul(rows)
            .ok_or_else(|| Error::InvalidShape(format!("dims {dims:?} overflow usize")))
    }
}

impl std::fmt::Display for QType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_type_finds_its_own_record() {
        assert_eq!(RECORDS.len(), QType::ALL.len());
        for (q, r) in QType::ALL.into_iter().zip(&RECORDS) {
            assert_eq!(r.qtype, q);
            assert_eq!(q.record().qtype, q);
            assert_eq!(q.is_quantized(), r.block_len > 1);
        }
    }

    #[test]
    fn ids_round_trip_and_names_are_unique() {
        for q in QType::ALL {
            assert_eq!(QType::from_id(q.id()), Some(q));
            assert_eq!(QType::from_name(q.name()), Some(q));
            assert_eq!(QType::from_name(&q.name().to_ascii_uppercase()), Some(q));
        }
        for q in QType::ggml() {
            assert!(q.is_ggml());
            assert_eq!(QType::from_ggml_id(q.ggml_id()), Some(q));
        }
        assert_eq!(
            QType::from_ggml_id(4),
            None,
            "ids 4 and 5 were removed from ggml"
        );
        let mut names: Vec<&str> = QType::ALL.iter().map(|q| q.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), QType::ALL.len());
    }

    #[test]
    fn ids_are_in_order_and_kiln_types_are_not_ggml() {
        assert!(QType::ALL.windows(2).all(|w| w[0].id() < w[1].id()));
        let ggml: Vec<QType> = QType::ggml().collect();
        assert!(ggml.windows(2).all(|w| w[0].id() < w[1].id()));
        let kiln_only: Vec<QType> = QType::ALL
            .into_iter()
            .filter(|q| !ggml.contains(q))
            .collect();
        assert_eq!(kiln_only, [QType::AprQ4]);
        assert!(ggml.iter().all(|q| QType::ALL.contains(q)));
        for q in kiln_only {
            assert!(q.id() >= 128 && !q.is_ggml(), "{q}");
            assert_eq!(
                QType::from_ggml_id(q.id()),
                None,
                "{q} must not be read from GGUF"
            );
        }
    }

    #[test]
    fn apr_q4_geometry() {
        let q = QType::AprQ4;
        assert_eq!(
            (
                q.id(),
                q.name(),
                q.block_len(),
                q.block_bytes(),
                q.is_quantized()
            ),
            (128, "apr_q4", 32, 18, true)
        );
        assert_eq!(QType::from_id(128), Some(q));
        assert_eq!(QType::from_name("APR_Q4"), Some(q));
        assert_eq!(q.row_bytes(64).unwrap(), 36);
        assert!(q.row_bytes(48).is_err());
    }

    #[test]
    fn row_bytes_checks_block_multiples() {
        assert_eq!(QType::Q4_K.row_bytes(512).unwrap(), 288);
        assert_eq!(QType::Q4_0.row_bytes(576).unwrap(), 18 * 18);
        assert!(QType::Q4_K.row_bytes(576).is_err());
        assert!(QType::F32.tensor_bytes(&[usize::MAX, 2]).is_err());
    }
}
