//! Tensor element types (ggml type ids) and their block geometry.

use crate::error::{Error, Result};

/// A tensor's storage type. Discriminants are ggml's type ids, which GGUF stores on disk.
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
    BF16 = 30,
}

impl QType {
    /// Every type kiln knows, in id order.
    pub const ALL: [QType; 15] = [
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
        QType::BF16,
    ];

    pub fn from_ggml_id(id: u32) -> Option<QType> {
        QType::ALL.iter().copied().find(|q| *q as u32 == id)
    }

    pub fn ggml_id(self) -> u32 {
        self as u32
    }

    /// Lower-case name as llama.cpp prints it (`q4_k`, `f16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            QType::F32 => "f32",
            QType::F16 => "f16",
            QType::Q4_0 => "q4_0",
            QType::Q4_1 => "q4_1",
            QType::Q5_0 => "q5_0",
            QType::Q5_1 => "q5_1",
            QType::Q8_0 => "q8_0",
            QType::Q8_1 => "q8_1",
            QType::Q2_K => "q2_k",
            QType::Q3_K => "q3_k",
            QType::Q4_K => "q4_k",
            QType::Q5_K => "q5_k",
            QType::Q6_K => "q6_k",
            QType::Q8_K => "q8_k",
            QType::BF16 => "bf16",
        }
    }

    pub fn from_name(name: &str) -> Option<QType> {
        let lower = name.to_ascii_lowercase();
        QType::ALL.iter().copied().find(|q| q.name() == lower)
    }

    /// Number of values in one block.
    pub fn block_len(self) -> usize {
        match self {
            QType::F32 | QType::F16 | QType::BF16 => 1,
            QType::Q4_0 | QType::Q4_1 | QType::Q5_0 | QType::Q5_1 | QType::Q8_0 | QType::Q8_1 => 32,
            QType::Q2_K | QType::Q3_K | QType::Q4_K | QType::Q5_K | QType::Q6_K | QType::Q8_K => 256,
        }
    }

    /// Bytes in one block.
    pub fn block_bytes(self) -> usize {
        match self {
            QType::F32 => 4,
            QType::F16 | QType::BF16 => 2,
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q5_0 => 22,
            QType::Q5_1 => 24,
            QType::Q8_0 => 34,
            QType::Q8_1 => 36,
            QType::Q2_K => 84,
            QType::Q3_K => 110,
            QType::Q4_K => 144,
            QType::Q5_K => 176,
            QType::Q6_K => 210,
            QType::Q8_K => 292,
        }
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
        (n / block)
            .checked_mul(self.block_bytes())
            .ok_or_else(|| Error::InvalidShape(format!("{n} values of {} overflow usize", self.name())))
    }

    /// Bytes of a tensor with these dims (`dims[0]` is the contiguous row length).
    pub fn tensor_bytes(self, dims: &[usize]) -> Result<usize> {
        let row_len = dims.first().copied().unwrap_or(1);
        let rows = dims.iter().skip(1).try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let rows = rows.ok_or_else(|| Error::InvalidShape(format!("dims {dims:?} overflow usize")))?;
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
    fn ids_round_trip_and_names_are_unique() {
        for q in QType::ALL {
            assert_eq!(QType::from_ggml_id(q.ggml_id()), Some(q));
            assert_eq!(QType::from_name(q.name()), Some(q));
        }
        assert_eq!(QType::from_ggml_id(4), None, "ids 4 and 5 were removed from ggml");
    }

    #[test]
    fn row_bytes_checks_block_multiples() {
        assert_eq!(QType::Q4_K.row_bytes(512).unwrap(), 288);
        assert_eq!(QType::Q4_0.row_bytes(576).unwrap(), 18 * 18);
        assert!(QType::Q4_K.row_bytes(576).is_err());
        assert!(QType::F32.tensor_bytes(&[usize::MAX, 2]).is_err());
    }
}
